"""Patched transformers models against PEFT, the oracle: one batch mixing the base model and every
adapter gives, row by row, PEFT's logits for that row's adapter.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY_ARCHS, save_peft_adapter, tiny_model, setenv
from peft import PeftModel

from loramux.engine.adapters.lora_model import LoRAModelManager
from loramux.registry import LoRAConfig, load_adapter
from loramux.registry.handle import memory_handle

ATTENTION = {
    "phi3": ["qkv_proj", "o_proj"],
    "gpt2": ["c_attn", "attn.c_proj"],
}
MLP = {
    "phi3": ["gate_up_proj", "down_proj"],
    "gpt2": ["c_fc", "mlp.c_proj"],
}
EMBEDDING = {"gpt2": "wte"}


def adapter_specs(arch: str) -> dict[str, dict]:
    """Three adapters per model: ranks, alphas, rslora, patterns, targets and embeddings differ."""
    attention = ATTENTION.get(arch, ["q_proj", "k_proj", "v_proj", "o_proj"])
    mlp = MLP.get(arch, ["gate_proj", "up_proj", "down_proj"])
    embedding = EMBEDDING.get(arch, "embed_tokens")
    extra = {"fan_in_fan_out": True} if arch == "gpt2" else {}
    return {
        "attn": dict(r=8, lora_alpha=16, target_modules=[*attention, "lm_head"], **extra),
        "mlp-rslora": dict(
            r=4,
            lora_alpha=32,
            use_rslora=True,
            target_modules=mlp,
            rank_pattern={mlp[0]: 2},
            alpha_pattern={mlp[-1]: 3},
            **extra,
        ),
        "embed": dict(r=6, lora_alpha=6, target_modules=[embedding, attention[0]], **extra),
    }


def make_adapters(arch, base, tmp_path, specs=None):
    specs = specs or adapter_specs(arch)
    return {
        name: save_peft_adapter(copy.deepcopy(base), tmp_path / name, seed=seed, **kwargs)
        for seed, (name, kwargs) in enumerate(specs.items(), start=1)
    }


def peft_oracle(base, dirs):
    peft_model = None
    for name, directory in dirs.items():
        if peft_model is None:
            peft_model = PeftModel.from_pretrained(copy.deepcopy(base), directory, adapter_name=name)
        else:
            peft_model.load_adapter(directory, adapter_name=name)
    return peft_model.eval()


def patched(base, dirs, *, max_loras=None, max_lora_rank=8, **kwargs):
    model = copy.deepcopy(base)
    config = LoRAConfig(max_loras=max_loras or len(dirs), max_lora_rank=max_lora_rank)
    manager = LoRAModelManager(model, config, **kwargs)
    return model, manager


def run(model, manager, input_ids, names, **kwargs):
    manager.set_mapping(manager.token_slots(names, input_ids.shape[1]))
    with torch.no_grad():
        return model(input_ids, **kwargs).logits


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    """A tiny Llama, its three adapters on disk and a PEFT model holding all of them."""
    base = tiny_model("llama")
    dirs = make_adapters("llama", base, tmp_path_factory.mktemp("llama"))
    return base, dirs, peft_oracle(base, dirs)


INPUT = torch.randint(3, 128, (5, 6), generator=torch.Generator().manual_seed(0))  # [B, S]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_mixed_batch_equals_peft(arch, tmp_path):
    base = tiny_model(arch)
    dirs = make_adapters(arch, base, tmp_path)
    names = [None, "attn", "mlp-rslora", "embed", "attn"]  # base rows and every adapter, mixed
    with torch.no_grad():
        expected = peft_oracle(base, dirs)(
            INPUT, adapter_names=[n or "__base__" for n in names]
        ).logits
        base_logits = base(INPUT).logits

    model, manager = patched(base, dirs)
    for name, directory in dirs.items():
        manager.activate(load_adapter(directory, name=name))
    got = run(model, manager, INPUT, names)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for row, name in enumerate(names):  # each adapter really changed its rows
        assert (name is None) == torch.equal(got[row], base_logits[row]), (row, name)
    if arch in ("gemma", "gpt2"):  # tied embeddings stay tied through both wrappers
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_logits_on_last_positions(llama_setup):
    base, dirs, oracle = llama_setup
    names = ["embed", None, "attn", "mlp-rslora", "attn"]
    with torch.no_grad():
        expected = oracle(INPUT, adapter_names=[n or "__base__" for n in names]).logits
    model, manager = patched(base, dirs)
    for name, directory in dirs.items():
        manager.activate(load_adapter(directory, name=name))
    # HF layout: logits_to_keep=2 on a [B, S] batch; lm_head sees [B, 2, H]
    got = run(model, manager, INPUT, names, logits_to_keep=2)
    torch.testing.assert_close(got, expected[:, -2:], rtol=1e-5, atol=1e-5)
    # the engine's layout: one packed row of tokens, logits at chosen rows, their slots given
    flat = INPUT.reshape(1, -1)  # [1, T]
    last = torch.arange(1, 6) * INPUT.shape[1] - 1  # the last token of every request
    token_slots = manager.token_slots(names, INPUT.shape[1])
    manager.set_mapping(token_slots, token_slots[last])
    with torch.no_grad():
        got = model(flat, logits_to_keep=last).logits[0]  # [5, V]
        hidden = model.model(flat).last_hidden_state[0, last]  # [5, H]
        peft_head = oracle.base_model.model.lm_head
        expected = peft_head(hidden[:, None], adapter_names=[n or "__base__" for n in names])[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_slot_reuse_after_eviction(llama_setup):
    base, dirs, oracle = llama_setup
    model, manager = patched(base, dirs, max_loras=2)
    adapters = {name: load_adapter(path, name=name) for name, path in dirs.items()}
    slot_attn = manager.activate(adapters["attn"])
    manager.activate(adapters["mlp-rslora"])
    manager.activate(adapters["attn"])  # touch: mlp-rslora is now least recently used
    slot_embed = manager.activate(adapters["embed"])
    assert manager.resident() == ["attn", "embed"]
    stats = manager.stats  # the GPU tier counts like the CPU tier: one hit, three copies in
    assert (stats.hits, stats.misses, stats.loads, stats.evictions) == (1, 3, 3, 1)
    assert manager.slot_of("mlp-rslora") is None and slot_embed != slot_attn
    names = ["embed", "attn", None, "embed", "attn"]
    with torch.no_grad():
        expected = oracle(INPUT, adapter_names=[n or "__base__" for n in names]).logits
    torch.testing.assert_close(run(model, manager, INPUT, names), expected, rtol=1e-5, atol=1e-5)
    # the slot embed took over held mlp-rslora's larger-rank MLP weights: nothing of them leaks
    manager.activate(adapters["mlp-rslora"])  # evicts attn
    assert manager.resident() == ["embed", "mlp-rslora"]
    names = ["mlp-rslora", "embed", None, "mlp-rslora", "embed"]
    with torch.no_grad():
        expected = oracle(INPUT, adapter_names=[n or "__base__" for n in names]).logits
    torch.testing.assert_close(run(model, manager, INPUT, names), expected, rtol=1e-5, atol=1e-5)


def test_forward_use_refreshes_the_eviction_order(llama_setup):
    base, dirs, _ = llama_setup
    model, manager = patched(base, dirs, max_loras=2)
    adapters = {name: load_adapter(path, name=name) for name, path in dirs.items()}
    manager.activate(adapters["attn"])
    manager.activate(adapters["embed"])
    manager.set_mapping(manager.token_slots(["attn", None]))  # attn used by this step
    assert manager.resident() == ["embed", "attn"]
    manager.activate(adapters["mlp-rslora"])
    assert manager.resident() == ["attn", "mlp-rslora"]


def with_handle(adapter, name):
    """The adapter as a registry serves it: with a handle of its own (a reload is a new handle)."""
    return dataclasses.replace(adapter, handle=memory_handle(adapter, name))


def test_a_reload_is_a_new_handle_in_its_own_slot_beside_the_old(llama_setup, tmp_path):
    """Slots key by handle id: the old weights keep serving their rows while the new ones serve
    others, in one batch, until the old handle's slot is freed."""
    base, dirs, oracle = llama_setup
    model, manager = patched(base, dirs)
    old = with_handle(load_adapter(dirs["attn"], name="attn"), "attn")
    old_slot = manager.activate(old)
    new_dir = save_peft_adapter(
        copy.deepcopy(base), tmp_path / "attn-v2", seed=99, r=4, target_modules=["v_proj", "up_proj"]
    )
    new = with_handle(load_adapter(new_dir, name="attn"), "attn")
    new_slot = manager.activate(new)
    assert new_slot != old_slot and manager.slot_of(old.handle.id) == old_slot
    assert manager.activate(new) == new_slot and manager.handle(new.handle.id) is new.handle  # a hit now
    rows = [old_slot, -1, new_slot, old_slot, new_slot]
    manager.set_mapping(torch.tensor(rows, dtype=torch.int32).repeat_interleave(INPUT.shape[1]))
    with torch.no_grad():
        got = model(INPUT).logits
    oracle.load_adapter(new_dir, adapter_name="attn-v2")
    with torch.no_grad():
        expected = oracle(INPUT, adapter_names=["attn", "__base__", "attn-v2", "attn", "attn-v2"]).logits
    oracle.delete_adapter("attn-v2")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert manager.deactivate(old.handle.id) and manager.resident() == ["attn"]
    assert manager.slot_of("attn") == new_slot  # by name: the one resident adapter of that name


def test_held_slots_are_never_evicted(llama_setup):
    from loramux.errors import CacheFullError, LoRAError

    base, dirs, _ = llama_setup
    model, manager = patched(base, dirs, max_loras=2)
    adapters = {name: load_adapter(path, name=name) for name, path in dirs.items()}
    manager.activate(adapters["attn"])
    manager.activate(adapters["embed"])
    manager.hold("attn")
    manager.hold("embed")
    assert not manager.can_activate("mlp-rslora") and manager.can_activate("attn")
    with pytest.raises(CacheFullError, match="mlp-rslora.*all 2 GPU LoRA slots"):
        manager.activate(adapters["mlp-rslora"])
    assert manager.resident() == ["attn", "embed"]
    with pytest.raises(LoRAError, match="in use by running requests"):
        manager.deactivate("embed")
    assert manager.is_held("embed")
    manager.release("attn")
    manager.activate(adapters["mlp-rslora"])  # evicts attn, the only one not held
    assert manager.resident() == ["embed", "mlp-rslora"]
    with pytest.raises(ValueError, match="holds no GPU slot"):
        manager.hold("attn")
    with pytest.raises(ValueError, match="is not held"):
        manager.release("mlp-rslora")


def _snapshot(manager):
    state = {
        name: [t.clone() for t in layer.buffers(recurse=False)]
        for name, layer in manager.layers.items()
    }
    return state, manager.resident(), [manager.slot_of(n) for n in manager.resident()]


def _assert_unchanged(manager, before):
    state, resident, slots = _snapshot(manager)
    assert (resident, slots) == before[1:]
    for name, tensors in state.items():
        for got, expected in zip(tensors, before[0][name]):
            assert torch.equal(got, expected), name


def test_failed_validation_leaves_model_unchanged(llama_setup, tmp_path):
    from loramux.errors import IncompatibleAdapterError

    base, dirs, _ = llama_setup
    model, manager = patched(base, dirs, max_loras=2, target_modules=["q_proj", "v_proj", "lm_head"])
    assert set(manager.layers) == {
        *(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")),
        "lm_head",
    }
    manager.activate(load_adapter(save_peft_adapter(copy.deepcopy(base), tmp_path / "ok", r=2), name="ok"))
    before = _snapshot(manager)

    def check(adapter, *patterns):
        with pytest.raises(IncompatibleAdapterError) as caught:
            manager.activate(adapter)
        message = str(caught.value)
        for pattern in patterns:
            assert pattern in message, message
        with pytest.raises(IncompatibleAdapterError):
            manager.validate(adapter)
        _assert_unchanged(manager, before)

    # rank above max_lora_rank (the loader was not told the bound)
    big = save_peft_adapter(copy.deepcopy(base), tmp_path / "big", r=16)
    check(load_adapter(big), "adapter 'big'", "'model.layers.0.self_attn.q_proj' has rank 16", "max_lora_rank=8")
    # left out by target_modules
    narrow = save_peft_adapter(copy.deepcopy(base), tmp_path / "narrow", target_modules=["q_proj", "k_proj"])
    check(load_adapter(narrow), "'model.layers.0.self_attn.k_proj'", "lora_target_modules=")
    # trained for another model: a module it lacks, and shapes that differ
    deeper = tiny_model("llama")
    deeper.model.layers.append(copy.deepcopy(deeper.model.layers[0]))
    extra = save_peft_adapter(deeper, tmp_path / "deeper", target_modules=["v_proj"])
    check(load_adapter(extra), "'model.layers.2.self_attn.v_proj'", "does not have")
    wider = copy.deepcopy(base)
    wider.model.layers[0].self_attn.v_proj = torch.nn.Linear(32, 24, bias=False)
    mismatch = save_peft_adapter(wider, tmp_path / "wider", target_modules=["v_proj"])
    check(load_adapter(mismatch), "'model.layers.0.self_attn.v_proj'", "[24, 8]", "[16, 8]")


def test_unsupported_layer_type_lists_the_supported_ones(llama_setup):
    from dataclasses import replace

    from loramux.errors import IncompatibleAdapterError

    base, dirs, _ = llama_setup
    model, manager = patched(base, dirs)
    adapter = load_adapter(dirs["attn"])
    norm = replace(adapter, name="norm", modules={"model.norm": adapter.modules["lm_head"]})
    with pytest.raises(
        IncompatibleAdapterError,
        match=r"'model\.norm', a .*LlamaRMSNorm.*supported layer types: torch\.nn\.Linear, "
        r"torch\.nn\.Embedding, transformers\.pytorch_utils\.Conv1D",
    ):
        manager.activate(norm)
    assert manager.resident() == []


def test_mapping_and_deactivation(llama_setup):
    base, dirs, _ = llama_setup
    model, manager = patched(base, dirs)
    with torch.no_grad():
        base_logits = base(INPUT).logits
    slot = manager.activate(load_adapter(dirs["attn"], name="attn"))
    manager.set_mapping(None)
    with torch.no_grad():
        assert torch.equal(model(INPUT).logits, base_logits)
    with pytest.raises(ValueError, match="hold no adapter"):
        manager.set_mapping(torch.full((INPUT.numel(),), (slot + 1) % 3))
    with pytest.raises(ValueError, match="holds no GPU slot"):
        manager.token_slots(["nope"])
    assert manager.deactivate("attn") and not manager.deactivate("attn")
    assert all(layer.slots.ranks.sum() == 0 and layer.slots.scales.abs().sum() == 0 for layer in manager.layers.values())
    with pytest.raises(ValueError, match="already a LoRA layer"):
        LoRAModelManager(model, LoRAConfig())


def test_triton_kernels_in_the_model(llama_setup, monkeypatch):
    """The same mixed batch through the Triton kernels (the interpreter on CPU)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    base, dirs, oracle = llama_setup
    names = [None, "attn", "mlp-rslora", "embed"]
    input_ids = INPUT[:4, :3]
    with torch.no_grad():
        expected = oracle(input_ids, adapter_names=[n or "__base__" for n in names]).logits
    model, manager = patched(base, dirs)
    for name, directory in dirs.items():
        manager.activate(load_adapter(directory, name=name))
    got = run(model, manager, input_ids, names)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# -- GPU, bfloat16 ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_mixed_batch_equals_peft_bf16_gpu(arch, tmp_path, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)  # CUDA tensors: the Triton kernels
    base = tiny_model(arch)
    dirs = make_adapters(arch, base, tmp_path)
    names = [None, "attn", "mlp-rslora", "embed", "attn"]
    input_ids = INPUT.cuda()
    with torch.no_grad():
        oracle = peft_oracle(base, dirs).to("cuda", torch.bfloat16)
        expected = oracle(input_ids, adapter_names=[n or "__base__" for n in names]).logits.float()
        exact = peft_oracle(base, dirs).cuda()(input_ids, adapter_names=[n or "__base__" for n in names]).logits

    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=3, max_lora_rank=8))
    for name, directory in dirs.items():  # fp32 pinned host weights, cast on copy into the slot
        manager.activate(load_adapter(directory, name=name).pin_memory())
    got = run(model, manager, input_ids, names).float()

    scale = exact.abs().max().item()
    assert (got - expected).abs().max().item() <= 0.03 * scale + 0.03
    # no worse against the float32 truth than PEFT itself in bfloat16
    assert (got - exact).abs().max().item() <= 2 * (expected - exact).abs().max().item() + 0.02 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_slot_reuse_and_reload_bf16_gpu(llama_setup, tmp_path, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)
    base, dirs, _ = llama_setup
    oracle = peft_oracle(base, dirs).to("cuda", torch.bfloat16)
    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8))
    adapters = {name: load_adapter(path, name=name).pin_memory() for name, path in dirs.items()}
    input_ids = INPUT.cuda()

    def check(names, peft_names=None):
        with torch.no_grad():
            expected = oracle(input_ids, adapter_names=peft_names or [n or "__base__" for n in names]).logits
        got = run(model, manager, input_ids, names)
        scale = expected.abs().max().item()
        assert (got.float() - expected.float()).abs().max().item() <= 0.03 * scale + 0.03

    manager.activate(adapters["mlp-rslora"])
    manager.activate(adapters["attn"])
    manager.activate(adapters["embed"])  # evicts mlp-rslora: its larger MLP slot must not leak
    assert manager.resident() == ["attn", "embed"]
    check(["embed", "attn", None, "embed", "attn"])
    new_dir = save_peft_adapter(copy.deepcopy(base), tmp_path / "v2", seed=7, r=4, target_modules=["o_proj"])
    assert manager.deactivate("attn")  # the old handle retired: its slot is free
    manager.activate(with_handle(load_adapter(new_dir, name="attn").pin_memory(), "attn"))
    oracle.load_adapter(new_dir, adapter_name="v2")
    oracle.to("cuda", torch.bfloat16)
    check(["attn", "embed", None, "attn", "embed"], ["v2", "embed", "__base__", "v2", "embed"])


def test_readme_example_runs():
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Patch a transformers model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    logits, manager = namespace["logits"], namespace["manager"]
    assert logits.shape == (3, 5, 128) and manager.resident() == ["sql", "chat"]


def test_validation_is_remembered_per_layout_and_another_shape_is_still_refused(llama_setup):
    from dataclasses import replace

    from loramux.errors import IncompatibleAdapterError

    base, dirs, _ = llama_setup
    _, manager = patched(base, dirs)
    good = load_adapter(dirs["attn"], name="attn")
    checks = []
    check = manager.validator._check
    manager.validator._check = lambda adapter: (checks.append(adapter.name), check(adapter))
    manager.validate(good)
    manager.validate(replace(good, name="same-layout"))
    assert checks == ["attn"]
    name, weights = next(iter(good.modules.items()))
    wider = replace(weights, lora_a=torch.zeros(weights.rank, weights.in_features + 1))
    with pytest.raises(IncompatibleAdapterError, match=name):
        manager.validate(replace(good, name="wider", modules={**good.modules, name: wider}))
