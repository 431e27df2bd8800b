"""LoRA layer wrappers: one conformance suite over every wrapper, built-in or from a plugin.

Each case is checked against a per-token loop: ``base(x_t) + sum_i scale_i * B_i(A_i(x_t))``.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import INTERPRET, save_peft_adapter, tiny_model, setenv
from layer_helpers import pool_of, reset_lora, set_lora
from torch import nn

from loramux.engine.layers import (
    BaseLayerWithLoRA,
    Conv1DWithLoRA,
    EmbeddingWithLoRA,
    LinearWithLoRA,
    LoRAContext,
)
from loramux.engine.layers import backend
from loramux.engine.layers.contract import Route
from loramux.engine.adapters.lora_model import LoRAModelManager, wrap_layer
from loramux.engine.adapters.lora_validation import describe_mismatch
from loramux.kernels.pool import pool_rows
from loramux.plugins.manager import get_plugin_manager, register_plugin
from loramux.registry import LoRAAdapter, LoRAConfig, LoRAModuleWeights, load_adapter

CONFIG = LoRAConfig(max_loras=3, max_lora_rank=8)
PLUGIN_FILE = Path(__file__).parent / "plugins" / "fused_qkv_lora.py"


def _load_example_plugin():
    spec = importlib.util.spec_from_file_location("fused_qkv_lora", PLUGIN_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fused_qkv_lora = _load_example_plugin()


@pytest.fixture
def qkv_plugin():
    """The example plugin, registered in-process for one test."""
    name = register_plugin(fused_qkv_lora, name="fused-qkv-example")
    try:
        yield fused_qkv_lora
    finally:
        get_plugin_manager().unregister(name=name)


@dataclass
class Case:
    make_base: Callable[[], nn.Module]
    wrapper_type: type
    is_embedding: bool = False
    needs_plugin: bool = False


def _conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(12, 16)  # nf=12 outputs, nx=16 inputs: weight [16, 12]


def _scaled_embedding():
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    return GemmaTextScaledWordEmbedding(50, 12, padding_idx=0, embed_scale=3.0)


CASES = {
    "linear": Case(lambda: nn.Linear(16, 12), LinearWithLoRA),
    "conv1d": Case(_conv1d, Conv1DWithLoRA),
    "embedding": Case(lambda: nn.Embedding(50, 12), EmbeddingWithLoRA, is_embedding=True),
    "scaled-embedding": Case(_scaled_embedding, EmbeddingWithLoRA, is_embedding=True),
    "plugin-fused-qkv": Case(
        lambda: fused_qkv_lora.FusedQKV(16, (6, 4, 2)), fused_qkv_lora.FusedQKVWithLoRA, needs_plugin=True
    ),
}


def random_weights(layer: BaseLayerWithLoRA, rank: int, seed: int) -> list[LoRAModuleWeights]:
    generator = torch.Generator().manual_seed(seed)
    return [
        LoRAModuleWeights(
            torch.randn(rank, layer.in_features, generator=generator),
            torch.randn(size, rank, generator=generator),
            scaling=0.5 + seed + i,
            is_embedding=layer.is_embedding,
        )
        for i, size in enumerate(layer.output_sizes)
    ]


def expected_output(layer, x, token_slots, weights_by_slot, multiplier=1.0):
    """The per-token loop the kernels must match."""
    out = layer.base_layer(x).reshape(-1, layer.out_features).clone()  # [T, out]
    flat = x.reshape(-1) if layer.is_embedding else x.reshape(-1, layer.in_features)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0 or weights_by_slot.get(slot) is None:
            continue
        pieces = []
        for w in weights_by_slot[slot]:
            hidden = w.lora_a[:, flat[t]] if layer.is_embedding else w.lora_a @ flat[t]  # [r]
            pieces.append(w.lora_b @ hidden * w.scaling * multiplier)
        out[t] += torch.cat(pieces)
    return out.reshape(*x.shape[: (x.dim() if layer.is_embedding else -1)], layer.out_features)


def build(case: Case) -> BaseLayerWithLoRA:
    torch.manual_seed(0)
    base = case.make_base()
    layer = wrap_layer(base, "block.proj", CONFIG)
    assert type(layer) is case.wrapper_type and layer.get_base_layer() is base
    layer.lora_context = LoRAContext(CONFIG.max_loras)
    pool_of(layer, CONFIG)
    return layer


def make_input(layer: BaseLayerWithLoRA, shape=(2, 5)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    if layer.is_embedding:
        return torch.randint(0, layer.in_features, shape, generator=generator)
    return torch.randn(*shape, layer.in_features, generator=generator)


@pytest.fixture(params=list(CASES))
def layer(request):
    case = CASES[request.param]
    if case.needs_plugin:
        request.getfixturevalue("qkv_plugin")
    return build(case)


@pytest.mark.parametrize("shape", [(2, 5), (7,)])
def test_matches_per_token_loop(layer, shape):
    weights = {0: random_weights(layer, 8, seed=1), 2: random_weights(layer, 3, seed=2)}
    for slot, by_slice in weights.items():
        set_lora(layer, slot, by_slice)
    x = make_input(layer, shape)
    token_slots = torch.tensor([2, -1, 0, 0, 1, 2, -1, 0, 2, 1][: x.shape[:len(shape)].numel()])
    layer.lora_context.set(token_slots)
    multiplier = float(getattr(layer.base_layer, "embed_scale", 1.0))
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, expected_output(layer, x, token_slots, weights, multiplier), rtol=1e-5, atol=1e-5)
    assert layer.slots.ranks.tolist() == [8, 0, 3]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("mapping", ["one adapter", "with base rows", "with an adapter off this layer"])
def test_a_prefill_adds_its_gemm_onto_the_stored_delta(kernels, mapping, monkeypatch):
    """Past `DECODE_MAX_TOKENS` tokens a bias-free projection stores its delta first and adds the
    base GEMM onto it (`_delta_then_gemm`): the per-token loop's output for a fused layer whose
    adapters target some of its slices (q/v of q/k/v), rows of base tokens and of an adapter that
    does not touch the layer exactly the base layer's; a shorter step adds the delta after."""
    from loramux.kernels.tiles import DECODE_MAX_TOKENS

    if kernels == "triton" and not INTERPRET:
        pytest.skip("the CPU run of the Triton kernels needs the interpreter")
    setenv(monkeypatch, "LORAMUX_KERNELS", kernels)
    torch.manual_seed(0)
    base = nn.Linear(16, 12, bias=False)
    base.loramux_slices = (("q_proj", 6), ("k_proj", 4), ("v_proj", 2))
    layer = wrap_layer(base, "self_attn.qkv_proj", CONFIG)
    layer.lora_context = LoRAContext(CONFIG.max_loras)
    qv, full = random_weights(layer, 8, seed=1), random_weights(layer, 3, seed=2)
    qv[1] = None  # k untargeted: its scale is 0, and its delta columns must come out zero
    set_lora(layer, 0, qv)
    set_lora(layer, 2, full)  # slot 1 holds nothing here: an adapter that leaves the layer alone
    T = DECODE_MAX_TOKENS + 44
    slots = {"one adapter": torch.zeros(T, dtype=torch.int64),
             "with base rows": torch.tensor([0, -1, 2, 0]).repeat(T // 4),
             "with an adapter off this layer": torch.tensor([0, 1, 2, 2]).repeat(T // 4)}[mapping]
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(3))
    expected = base(x).detach().clone()
    for t, slot in enumerate(slots.tolist()):
        pieces = {0: qv, 2: full}.get(slot)
        if pieces:
            expected[t] += torch.cat([w.lora_b @ (w.lora_a @ x[t]) * w.scaling if w else torch.zeros(4)
                                      for w in pieces])
    empty = torch.empty

    def poisoned(*args, **kwargs):  # new buffers hold NaN: whatever the layer never writes shows
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    for tokens in (T, DECODE_MAX_TOKENS):  # through the GEMM onto the delta, then in line
        layer.lora_context.set(slots[:tokens])
        route = backend._route(layer, x[:tokens], layer.lora_context.meta)
        assert route is (Route.DELTA_THEN_GEMM if tokens == T else Route.BASE_THEN_DELTA)
        with torch.no_grad():
            got = layer(x[:tokens])
        torch.testing.assert_close(got, expected[:tokens], rtol=1e-5, atol=1e-5)
        untouched = (slots[:tokens] == -1) | (slots[:tokens] == 1)
        assert torch.equal(got[untouched], base(x[:tokens])[untouched]), "a row without an adapter here changed"


def test_without_mapping_is_exactly_the_base_layer(layer):
    set_lora(layer, 0, random_weights(layer, 4, seed=1))
    x = make_input(layer)
    with torch.no_grad():
        expected = layer.base_layer(x)
        assert torch.equal(layer(x), expected)  # no mapping at all
        layer.lora_context.set(torch.full((10,), -1))
        assert torch.equal(layer(x), expected)  # every token on the base model
        layer.lora_context.set(torch.full((10,), 1))
        assert torch.equal(layer(x), expected)  # an adapter that does not touch this layer


def test_smaller_rank_and_reset_leave_no_residue(layer):
    set_lora(layer, 1, random_weights(layer, 8, seed=1))
    small = random_weights(layer, 2, seed=3)
    set_lora(layer, 1, small)
    slots = layer.slots
    for (a, b), w in zip(slots.slot_weights(1), small):
        assert torch.equal(a, w.lora_a) and torch.equal(b, w.lora_b)
    _, block = slots.block(slots.rows.start_of(1), pool_rows(2))
    assert not block[:, 2:].any()  # the rank-8 adapter's columns past rank 2 are gone
    # the slot owns its region, pool_rows(2) = 8 rows of it
    assert slots.rows.free_units == slots.rows.units - pool_rows(2)
    assert slots.ranks[1] == 2
    reset_lora(layer, 1)
    assert not slots.scales.any() and not slots.ranks.any()
    assert slots.rows.free_units == slots.rows.units and 1 not in slots.rows


def test_weights_are_cast_on_copy(layer):
    weights = [
        LoRAModuleWeights(w.lora_a.double(), w.lora_b.double(), w.scaling, w.is_embedding)
        for w in random_weights(layer, 4, seed=1)
    ]
    set_lora(layer, 0, weights)
    a, b = layer.slots.slot_weights(0)[0]
    assert a.dtype == b.dtype == layer.lora_dtype == torch.float32
    assert torch.equal(a, weights[0].lora_a.float()) and torch.equal(b, weights[0].lora_b.float())


def test_model_dtype_changes_keep_scales_in_float32(layer):
    layer.to(torch.float64)
    assert layer.lora_dtype == torch.float64 and layer.slots.scales.dtype == torch.float32
    assert layer.slots.ranks.dtype == layer.slots.pool_starts.dtype == torch.int32


def test_mismatches_are_described(layer):
    good = random_weights(layer, 4, seed=1)
    assert describe_mismatch(layer, good) is None
    wide = LoRAModuleWeights(torch.zeros(4, layer.in_features + 1), good[0].lora_b, 1.0, layer.is_embedding)
    problem = describe_mismatch(layer, [wide, *good[1:]])
    assert f"[4, {layer.in_features + 1}]" in problem and f"[4, {layer.in_features}]" in problem
    big = random_weights(layer, 9, seed=1)
    assert "rank 9, above max_lora_rank=8" in describe_mismatch(layer, big)
    other_kind = [LoRAModuleWeights(w.lora_a, w.lora_b, 1.0, not layer.is_embedding) for w in good]
    assert "holds a" in describe_mismatch(layer, other_kind)
    cube = LoRAModuleWeights(good[0].lora_a[..., None], good[0].lora_b[..., None], 1.0, layer.is_embedding)
    assert "not matrices" in describe_mismatch(layer, [cube, *good[1:]])  # no layout hook: refused
    with pytest.raises(ValueError):
        set_lora(layer, 0, big)


# -- the create_lora_layer hook ---------------------------------------------------------------------


def test_builtin_hook_wraps_supported_types_only():
    assert isinstance(wrap_layer(nn.Linear(4, 4), "x", CONFIG), LinearWithLoRA)
    assert wrap_layer(nn.LayerNorm(4), "x", CONFIG) is None
    assert wrap_layer(nn.ReLU(), "x", CONFIG) is None
    assert wrap_layer(fused_qkv_lora.FusedQKV(4, (2, 1, 1)), "x", CONFIG) is None


def test_plugin_answers_before_the_builtin(qkv_plugin):
    class MyLinearWithLoRA(LinearWithLoRA):
        pass

    from loramux.plugins.hookspecs import hookimpl

    class LinearPlugin:
        @staticmethod
        @hookimpl
        def create_lora_layer(base_layer, module_name, lora_config):
            if module_name.endswith("special"):
                return MyLinearWithLoRA(base_layer, module_name, lora_config)
            return None  # declined: the built-in answers

    name = register_plugin(LinearPlugin(), name="linear-example")
    try:
        assert type(wrap_layer(nn.Linear(4, 4), "a.special", CONFIG)) is MyLinearWithLoRA
        assert type(wrap_layer(nn.Linear(4, 4), "a.other", CONFIG)) is LinearWithLoRA
    finally:
        get_plugin_manager().unregister(name=name)


class SplitBlock(nn.Module):
    """What the adapters were trained on: separate q/k/v projections."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 6, bias=False), nn.Linear(16, 4, bias=False), nn.Linear(16, 2, bias=False)
        self.out = nn.Linear(12, 16)

    def forward(self, x):
        return self.out(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1))


class FusedBlock(nn.Module):
    """What is served: one fused projection with the same weights."""

    def __init__(self, split: SplitBlock) -> None:
        super().__init__()
        self.qkv = fused_qkv_lora.FusedQKV(16, (6, 4, 2))
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([split.q_proj.weight, split.k_proj.weight, split.v_proj.weight]))
        self.out = copy.deepcopy(split.out)

    def forward(self, x):
        return self.out(self.qkv(x))


def test_example_plugin_serves_split_adapters_on_a_fused_layer(qkv_plugin, tmp_path):
    from peft import PeftModel

    torch.manual_seed(0)
    split = SplitBlock().eval()
    dirs = {
        "qkv": save_peft_adapter(copy.deepcopy(split), tmp_path / "qkv", seed=1, target_modules=["q_proj", "k_proj", "v_proj", "out"]),
        "kv": save_peft_adapter(copy.deepcopy(split), tmp_path / "kv", seed=2, r=3, target_modules=["k_proj", "v_proj"]),
    }
    oracle = PeftModel.from_pretrained(copy.deepcopy(split), dirs["qkv"], adapter_name="qkv")
    oracle.load_adapter(dirs["kv"], adapter_name="kv")

    fused = FusedBlock(split).eval()
    manager = LoRAModelManager(fused, CONFIG)
    assert type(manager.layers["qkv"]) is fused_qkv_lora.FusedQKVWithLoRA
    assert manager.layers["qkv"].slice_names == ("q_proj", "k_proj", "v_proj")
    for name, directory in dirs.items():
        manager.activate(load_adapter(directory, name=name))
    x = torch.randn(3, 4, 16)
    names = ["kv", None, "qkv"]
    manager.set_mapping(manager.token_slots(names, 4))
    with torch.no_grad():
        got = fused(x)
        expected = oracle(x, adapter_names=[n or "__base__" for n in names])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_without_the_plugin_its_layer_is_unsupported():
    from loramux.errors import IncompatibleAdapterError

    torch.manual_seed(0)
    model = FusedBlock(SplitBlock())
    manager = LoRAModelManager(model, CONFIG)
    assert set(manager.layers) == {"out"}
    weights = LoRAModuleWeights(torch.zeros(2, 16), torch.zeros(12, 2), 1.0)
    adapter = LoRAAdapter("fused", Path("."), {"qkv": weights}, 2, ["qkv"])
    with pytest.raises(IncompatibleAdapterError, match=r"FusedQKV, which loramux cannot apply LoRA to.*Install a plugin"):
        manager.validate(adapter)


def test_wrapped_embeddings_stay_tied():
    model = tiny_model("gpt2")
    manager = LoRAModelManager(model, CONFIG)
    assert isinstance(model.lm_head, LinearWithLoRA) and isinstance(model.transformer.wte, EmbeddingWithLoRA)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not any("lora_" in key for key in model.state_dict())  # slots are not model weights
    model.tie_weights()  # transformers re-ties through the wrappers
    assert model.lm_head.base_layer.weight is model.transformer.wte.base_layer.weight
    assert "transformer.wte" in manager.layers and "lm_head" in manager.layers


def test_a_wrapper_without_slots_falls_back_to_the_builtin(caplog):
    from loramux.plugins.hookspecs import hookimpl

    class Opaque(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_layer(self):
            return self.base

    class OpaquePlugin:
        @staticmethod
        @hookimpl
        def create_lora_layer(base_layer, module_name, lora_config):
            return Opaque(base_layer)

    name = register_plugin(OpaquePlugin(), name="opaque-example")
    try:
        assert type(wrap_layer(nn.Linear(4, 4), "a.proj", CONFIG)) is LinearWithLoRA
        assert "plugin 'opaque-example'" in caplog.text
        assert "not a loramux.engine.layers.BaseLayerWithLoRA" in caplog.text and "Subclass BaseLayerWithLoRA" in caplog.text
    finally:
        get_plugin_manager().unregister(name=name)
