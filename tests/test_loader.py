"""load_adapter: PEFT's own tensors and scalings come back, and every bad input is refused clearly."""

import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from loramux.errors import AdapterNotFoundError, IncompatibleAdapterError, InvalidAdapterError
from loramux.registry import LoRAConfig, load_adapter

CASES = {
    "default": dict(),
    "rank4-alpha32": dict(r=4, lora_alpha=32, target_modules=["q_proj", "k_proj", "o_proj"]),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "down_proj"]),
    "rank-alpha-patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, "up_proj": 4},
        alpha_pattern={"v_proj": 3},
    ),
    "regex-targets": dict(target_modules=r".*layers\.0\.self_attn\.(q|k)_proj"),
    "embedding-and-lm-head": dict(target_modules=["embed_tokens", "lm_head", "q_proj"]),
    "layers-to-transform": dict(target_modules=["q_proj"], layers_to_transform=[1]),
}


def peft_modules(model, **lora_kwargs):
    """PEFT's own view of an adapter: module name -> (A, B, scaling)."""
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    found = {}
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            found[name] = (module.lora_A["default"].weight, module.lora_B["default"].weight)
        elif hasattr(module, "lora_embedding_A") and "default" in module.lora_embedding_A:
            found[name] = (module.lora_embedding_A["default"], module.lora_embedding_B["default"])
        else:
            continue
        found[name] += (module.scaling["default"],)
    return peft_model, found


@pytest.mark.parametrize("case", CASES)
def test_loading_matches_peft(case, tmp_path):
    peft_model, expected = peft_modules(tiny_llama(), **CASES[case])
    peft_model.save_pretrained(tmp_path / case)
    adapter = load_adapter(tmp_path / case)
    assert adapter.name == case
    assert set(adapter.modules) == set(expected)
    for name, (lora_a, lora_b, scaling) in expected.items():
        weights = adapter.modules[name]
        torch.testing.assert_close(weights.lora_a, lora_a.detach(), rtol=0, atol=0)
        torch.testing.assert_close(weights.lora_b, lora_b.detach(), rtol=0, atol=0)
        assert weights.scaling == pytest.approx(scaling)
        assert weights.is_embedding == name.endswith("embed_tokens")
    assert adapter.rank == max(a.shape[0] for a, _, _ in expected.values())
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b, _ in expected.values())
    assert adapter.lora_alpha == CASES[case].get("lora_alpha", 8)  # PEFT's default alpha
    targets = CASES[case].get("target_modules")
    if isinstance(targets, str):
        assert adapter.target_modules == targets
    elif targets:
        assert set(adapter.target_modules) == set(targets)


def test_gpt2_conv1d_fan_in_fan_out(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32))
    lora = dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    peft_model, expected = peft_modules(model, **lora)
    peft_model.save_pretrained(tmp_path / "gpt2")
    adapter = load_adapter(tmp_path / "gpt2")
    # PEFT keeps A [r, in] and B [out, r] for Conv1D too; only merging transposes.
    weights = adapter.modules["transformer.h.0.attn.c_attn"]
    assert weights.lora_a.shape == (8, 32) and weights.lora_b.shape == (96, 8)
    torch.testing.assert_close(weights.lora_b, expected["transformer.h.0.attn.c_attn"][1].detach())


def test_pickle_bin_loads_with_weights_only(tmp_path, make_adapter):
    source = make_adapter()
    directory = tmp_path / "bin-adapter"
    directory.mkdir()
    shutil.copy(source / "adapter_config.json", directory)
    torch.save(load_file(source / "adapter_model.safetensors"), directory / "adapter_model.bin")
    from_bin, from_safetensors = load_adapter(directory), load_adapter(source)
    for name, weights in from_safetensors.modules.items():
        assert torch.equal(from_bin.modules[name].lora_b, weights.lora_b)


def test_config_dtype_and_rank_bound(make_adapter):
    path = make_adapter(r=8)
    adapter = load_adapter(path, LoRAConfig(max_lora_rank=8, lora_dtype="bfloat16"))
    assert all(w.lora_a.dtype == torch.bfloat16 for w in adapter.modules.values())
    with pytest.raises(IncompatibleAdapterError) as excinfo:
        load_adapter(path, LoRAConfig(max_lora_rank=4))
    assert "rank is 8, above max_lora_rank=4" in str(excinfo.value)
    assert "--max-lora-rank" in str(excinfo.value) and path.name in str(excinfo.value)


# -- bad inputs: each gives a clear error naming the adapter and the file ----------------------


@pytest.fixture
def adapter_copy(make_adapter, tmp_path):
    """A fresh, writable copy of a valid adapter, to break in one way per test."""
    return shutil.copytree(make_adapter(), tmp_path / "broken")


def edit_config(directory, **changes):
    config_file = directory / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def assert_refused(directory, error_type, *fragments, **kwargs):
    with pytest.raises(error_type) as excinfo:
        load_adapter(directory, **kwargs)
    message = str(excinfo.value)
    assert "adapter 'broken'" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return excinfo.value


def test_missing_directory(tmp_path):
    with pytest.raises(AdapterNotFoundError, match="no adapter directory"):
        load_adapter(tmp_path / "nothing-here")


def test_missing_config(adapter_copy):
    (adapter_copy / "adapter_config.json").unlink()
    assert_refused(adapter_copy, InvalidAdapterError, "adapter_config.json is missing", "save_pretrained")


def test_unreadable_config(adapter_copy):
    (adapter_copy / "adapter_config.json").write_text("{not json")
    assert_refused(adapter_copy, InvalidAdapterError, "cannot be read as JSON")


def test_missing_weights(adapter_copy):
    (adapter_copy / "adapter_model.safetensors").unlink()
    assert_refused(adapter_copy, InvalidAdapterError, "no weights", "adapter_model.safetensors")


def test_truncated_safetensors(adapter_copy):
    weights = adapter_copy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    error = assert_refused(adapter_copy, InvalidAdapterError, "corrupt or truncated")
    assert error.path.endswith("adapter_model.safetensors")


def test_garbage_safetensors(adapter_copy):
    (adapter_copy / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    assert_refused(adapter_copy, InvalidAdapterError, "corrupt or truncated")


def test_shapes_inconsistent_with_rank(adapter_copy):
    edit_config(adapter_copy, r=4)
    assert_refused(adapter_copy, InvalidAdapterError, "config says rank 4", "(8, 32)")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(use_dora=True), "DoRA (use_dora) is not supported"),
        (dict(bias="all"), "bias='all' is not supported"),
        (dict(bias="lora_only"), "bias='lora_only' is not supported"),
        (dict(peft_type="IA3"), "peft_type is 'IA3'"),
        (dict(peft_type=None), "LoRA adapters only"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(lora_bias=True), "lora_bias"),
        (dict(r=0), "r=0 in the config"),
        (dict(lora_alpha="big"), "lora_alpha='big'"),
    ],
)
def test_unsupported_features_named(adapter_copy, changes, fragment):
    edit_config(adapter_copy, **changes)
    assert_refused(adapter_copy, InvalidAdapterError, fragment)


def test_pickle_payload_is_refused_and_never_runs(adapter_copy, tmp_path):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (adapter_copy / "adapter_model.safetensors").unlink()
    (adapter_copy / "adapter_model.bin").write_bytes(pickle.dumps({"x": Payload()}))
    assert_refused(adapter_copy, InvalidAdapterError, "refused to load adapter_model.bin", "safetensors")
    assert not marker.exists()


def test_base_model_mismatch(adapter_copy):
    edit_config(adapter_copy, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    assert_refused(
        adapter_copy, IncompatibleAdapterError, "trained for base model 'meta-llama/Llama-3.1-8B'",
        base_model_name="Qwen/Qwen2.5-7B",
    )
    # The same model named by a local checkout is accepted.
    assert load_adapter(adapter_copy, base_model_name="/models/Llama-3.1-8B").modules


def test_unexpected_and_missing_tensors(adapter_copy):
    weights_file = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    key_b = next(k for k in tensors if "lora_B" in k)
    save_file({k: v for k, v in tensors.items() if k != key_b}, weights_file)
    assert_refused(adapter_copy, InvalidAdapterError, "has no lora_B tensor")
    save_file({**tensors, "base_model.model.x.lora_magnitude_vector": torch.ones(3)}, weights_file)
    assert_refused(adapter_copy, InvalidAdapterError, "unexpected tensor", "lora_magnitude_vector")


def test_non_finite_weights(adapter_copy):
    weights_file = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    key = next(iter(tensors))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights_file)
    assert_refused(adapter_copy, InvalidAdapterError, "NaN or infinity")


def test_good_adapter_still_loads_after_bad_ones(make_adapter, adapter_copy):
    (adapter_copy / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapterError):
        load_adapter(adapter_copy)
    assert load_adapter(make_adapter()).rank == 8


def test_pack_puts_every_tensor_in_one_buffer_cast_on_the_copy(make_adapter):
    adapter = load_adapter(make_adapter("packed"))
    packed = adapter.pack(torch.float16)
    tensors = [t for w in packed.modules.values() for t in (w.lora_a, w.lora_b)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.dtype == torch.float16 and t.data_ptr() % 64 == 0 for t in tensors)
    for name, weights in adapter.modules.items():
        assert torch.equal(packed.modules[name].lora_a, weights.lora_a.half())
        assert packed.modules[name].scaling == weights.scaling
    assert not packed.is_pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_weights_are_read_straight_into_page_locked_memory(make_adapter):
    path = make_adapter("pinned")
    adapter = load_adapter(path, pin_memory=True)
    assert adapter.is_pinned
    storages = {t.untyped_storage().data_ptr() for w in adapter.modules.values() for t in (w.lora_a, w.lora_b)}
    assert len(storages) == 1  # views of the one read buffer: no copy after the read
    cast = load_adapter(path, LoRAConfig(lora_dtype="float16"), pin_memory=True)
    assert cast.is_pinned and next(iter(cast.modules.values())).lora_a.dtype == torch.float16


def test_skipped_tensors_do_not_keep_the_read_buffer_alive(tmp_path):
    # PEFT saves the base embedding (base_layer.weight) beside an embedding LoRA; loramux skips it
    peft_model, _ = peft_modules(tiny_llama(), r=2, target_modules=["embed_tokens", "q_proj"])
    peft_model.save_pretrained(tmp_path / "with-base")
    file_bytes = (tmp_path / "with-base" / "adapter_model.safetensors").stat().st_size
    adapter = load_adapter(tmp_path / "with-base")
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for w in adapter.modules.values() for t in (w.lora_a, w.lora_b)}
    assert sum(held.values()) <= 1.25 * adapter.nbytes + 4096 < file_bytes


def test_a_non_finite_tensor_loramux_skips_does_not_refuse_the_adapter(tmp_path):
    # PEFT saves the base embedding beside an embedding LoRA; loramux never applies it, so its values
    # cannot refuse the adapter, while a NaN in the LoRA weights beside it still does
    peft_model, expected = peft_modules(tiny_llama(), r=2, target_modules=["embed_tokens", "q_proj"])
    peft_model.save_pretrained(tmp_path / "broken")
    weights_file = tmp_path / "broken" / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    base_key = next(k for k in tensors if k.endswith("base_layer.weight"))
    tensors[base_key][3, 1] = float("inf")
    save_file(tensors, weights_file)
    adapter = load_adapter(tmp_path / "broken")
    assert set(adapter.modules) == set(expected)
    lora_key = next(k for k in tensors if "lora_embedding_A" in k)
    tensors[lora_key][0, 0] = float("nan")
    save_file(tensors, weights_file)
    assert_refused(tmp_path / "broken", InvalidAdapterError, "embed_tokens", "NaN or infinity")


def test_a_file_scanned_finite_while_read_is_not_checked_again(make_adapter, monkeypatch):
    """The scan beside the read answers for the whole file; the check of the kept tensors runs only
    when it found a NaN or infinity somewhere (the test above: in a tensor loramux skips)."""
    import loramux.registry.loader as loader

    path = make_adapter("scanned", model=tiny_llama())

    def no_second_check(*args):
        raise AssertionError("checked again")

    monkeypatch.setattr(loader, "spans_finite", no_second_check)
    assert load_adapter(path).modules


def test_adapters_of_one_layout_share_its_parsed_header_but_each_keeps_its_own_config(make_adapter):
    from functools import partial

    from loramux.registry.weights_io import read_and_hash, read_layout

    model = tiny_llama()
    paths = [make_adapter("layout-a", model=model, lora_alpha=16),
             make_adapter("layout-b", model=model, lora_alpha=32, seed=1)]
    allocate = partial(torch.empty, dtype=torch.uint8)
    layouts = [read_layout(read_and_hash(p / "adapter_model.safetensors", allocate)[0]) for p in paths]
    assert layouts[0] is layouts[1]  # byte-identical headers: parsed once
    first, second = (load_adapter(p) for p in paths)
    name = "model.layers.0.self_attn.q_proj"
    assert (first.modules[name].scaling, second.modules[name].scaling) == (2.0, 4.0)
    assert not torch.equal(first.modules[name].lora_a, second.modules[name].lora_a)
    nan_file = paths[1] / "adapter_model.safetensors"
    data = bytearray(nan_file.read_bytes())
    data[-4:] = bytes.fromhex("0000c07f")  # the layout and its plan are known: still checked
    nan_file.write_bytes(bytes(data))
    with pytest.raises(InvalidAdapterError, match="NaN or infinity"):
        load_adapter(paths[1])


def test_a_load_reports_its_stages_and_the_same_adapter_and_digest(make_adapter):
    """``stages=`` receives the loader's own timings (benchmarks read them); nothing else changes."""
    from loramux.registry import load_adapter_with_digest

    path = make_adapter("staged")
    stages: dict[str, float] = {}
    adapter, digest = load_adapter_with_digest(path, stages=stages)
    plain, plain_digest = load_adapter_with_digest(path)
    assert set(stages) == {"read", "checks", "digest_wait"} and all(v >= 0 for v in stages.values())
    assert stages["read"] > 0 and digest == plain_digest and adapter.modules.keys() == plain.modules.keys()
