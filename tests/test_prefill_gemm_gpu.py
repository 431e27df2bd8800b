"""A prefill's delta stored first and the base GEMM added onto it (the backend's `Route.DELTA_THEN_GEMM`),
on the GPU in bfloat16 at Llama-3.1-8B's fused shapes: the float64 reference's output, as close to it
as the delta added after the GEMM, and rows without an adapter there the base GEMM's output.
Run on the GPU machine: ``pytest -m gpu tests/test_prefill_gemm_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err, setenv
from layer_helpers import pool_of, set_lora
from torch import nn

from loramux.engine.layers import LoRAContext, Route, backend
from loramux.engine.adapters.lora_model import wrap_layer
from loramux.registry import LoRAConfig, LoRAModuleWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {  # in_features, slices: 8B's fused qkv and gate_up
    "qkv": (4096, (("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024))),
    "gate_up": (4096, (("gate_proj", 14336), ("up_proj", 14336))),
}


@torch.no_grad()
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_prefill_through_the_gemm_onto_its_delta_matches_the_reference(shape, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)
    in_features, slices = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(in_features, sum(n for _, n in slices), bias=False)
    nn.init.normal_(base.weight, std=in_features ** -0.5, generator=gen)
    base.loramux_slices = slices
    layer = wrap_layer(base.to("cuda", torch.bfloat16), "mlp.fused", LoRAConfig(max_loras=4, max_lora_rank=16))
    layer.lora_context = LoRAContext(4)
    pool_of(layer)
    weights = {}
    for slot, (rank, skip) in {0: (16, 0), 2: (8, None)}.items():  # slot 0 leaves its first slice alone
        weights[slot] = [None if i == skip else LoRAModuleWeights(
            torch.randn(rank, in_features, generator=gen) * in_features ** -0.5,
            torch.randn(n, rank, generator=gen) * rank ** -0.5, scaling=2.0) for i, (_, n) in enumerate(slices)]
        set_lora(layer, slot, weights[slot])
    T = 1024
    slots = torch.tensor([0, 2, -1, 0]).repeat(T // 4)  # two adapters and base rows; slot 1 holds nothing
    x = torch.randn(T, in_features, generator=gen)
    ref = x.double() @ base.weight.double().cpu().t()
    for t, slot in enumerate(slots.tolist()):
        for i, w in enumerate(weights.get(slot, [])):
            if w is not None:
                start = sum(n for _, n in slices[:i])
                ref[t, start : start + w.lora_b.shape[0]] += (w.lora_b.double() @ (w.lora_a.double() @ x[t].double())
                                                              * w.scaling)
    x = x.to("cuda", torch.bfloat16)
    layer.lora_context.set(slots.to("cuda", torch.int32))
    assert backend._route(layer, x, layer.lora_context.meta) is Route.DELTA_THEN_GEMM
    onto_delta = layer(x).double().cpu()
    layer.route_plan = layer.route_plan._replace(eager_prefill=Route.BASE_THEN_DELTA)  # the delta added after the GEMM
    after = layer(x).double().cpu()
    assert rel_err(onto_delta, ref) < 8e-3 and rel_err(onto_delta, ref) <= 1.25 * rel_err(after, ref)
    base_rows = slots == -1  # the GEMM's own output (cuBLAS may pick another kernel for C = 0: to rounding)
    assert rel_err(onto_delta[base_rows], base(x).double().cpu()[base_rows]) < 4e-3
