"""On the GPU: a LoRA step captured in a CUDA graph with every projection's delta on the
side stream, beside a base GEMM that leaves it multiprocessors, replays what the eager step
computes, and both equal the sequential path (delta added after the base GEMM) to rounding.
Run on the GPU machine: ``pytest -m gpu tests/test_layer_side_stream_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, setenv
from layer_helpers import in_order as delta_after_base

import loramux.engine.layers.side_stream as side_stream_module
from loramux.engine.layers import Route
from loramux.engine.adapters.lora_model import LoRAModelManager
from loramux.registry import LoRAConfig, load_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, S = 4, 5  # 4 sequences of 5 tokens, one row of adapters per sequence
MAPPINGS = {  # adapters and base rows mixed, swapped between replays; then base rows only
    "mixed": [None, "attn", "all", "attn"],
    "swapped": ["all", None, "attn", None],
    "base rows only": [None, None, None, None],
}


@torch.no_grad()
def test_a_captured_step_with_the_delta_beside_the_base_gemm_equals_eager_and_sequential(
        engine_adapters, monkeypatch):
    """bfloat16. Replay and eager are compared exactly: the same kernels on the same inputs with the
    same launch shapes (one static meta), and a row's values never depend on its neighbours'. A
    missing join would let the sum read the delta of the previous replay, which held another
    mapping's adapters. The sequential path sizes its launches for every multiprocessor and runs
    the GEMM without the carveout (other split sums, another GEMM kernel): equal to rounding."""
    setenv(monkeypatch, "LORAMUX_KERNELS", None)  # the Triton kernels: the side stream applies
    device = torch.device("cuda")
    assert side_stream_module.delta_beside_base(device)
    assert side_stream_module.lora_sms_beside(B * S, device) > 0  # the GEMM leaves SMs at this size
    model = tiny_llama().to(device, torch.bfloat16)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8))
    projections = [layer for layer in manager.layers.values() if not layer.is_embedding and not layer.computes_logits]
    assert all(layer.route_plan.graph is Route.DELTA_BESIDE for layer in projections)
    for name in ("attn", "all"):
        manager.activate(load_adapter(engine_adapters[name], name=name))
    ids = torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(3)).to(device)
    slots = manager.token_slots(MAPPINGS["mixed"], S)  # [B*S] int32: the graph's static input

    forks = []
    real_side_stream = side_stream_module.side_stream
    monkeypatch.setattr(side_stream_module, "side_stream", lambda dev: forks.append(dev) or real_side_stream(dev))

    def forward() -> torch.Tensor:
        """Every wrapped projection of every layer, chained as the layer chains them (attention
        itself left out: transformers builds its mask with host copies, which a capture refuses);
        [B, features], one row per sequence."""
        h = model.model.embed_tokens(ids)  # [B, S, H]
        outs = []
        for layer in model.model.layers:
            attn = layer.self_attn
            outs += [attn.k_proj(h), attn.v_proj(h)]
            h = h + attn.o_proj(attn.q_proj(h))
            h = h + layer.mlp(h)
        return torch.cat([t.reshape(B, -1) for t in (h, *outs)], dim=1)

    def step() -> torch.Tensor:  # the kernel metadata is built inside the graph, as the engine does
        manager.set_mapping(slots, static=True)
        return forward()

    def sequential() -> torch.Tensor:
        with delta_after_base(*manager.layers.values()):
            return step()

    manager.set_mapping(None)
    base_out = forward()

    # warm up outside the capture (Triton compiles, the split-K table, the side stream), as cuda_graphs does
    warm = torch.cuda.Stream(device)
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    forks.clear()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        replayed = step()
    manager.set_mapping(None)
    assert forks, "no projection forked its delta while the graph was captured"

    for label, names in MAPPINGS.items():
        slots.copy_(manager.token_slots(names, S))
        graph.replay()
        got = replayed.clone()
        eager = step()
        in_order = sequential()
        manager.set_mapping(None)
        error = ((eager.double() - in_order.double()).norm() / in_order.double().norm()).item()
        assert error < 1e-2, f"{label}: eager vs sequential, relative error {error:.1e}"
        torch.testing.assert_close(got, eager, rtol=0, atol=0, msg=f"{label}: replay != eager")
        for row, name in enumerate(names):
            if name is None:  # base rows get no delta: the base model's output, to the GEMM's rounding
                torch.testing.assert_close(got[row], base_out[row], msg=f"{label}: row {row}")
            else:
                assert (got[row] - base_out[row]).abs().max() > 0.01, f"{label}: adapter row {row} unchanged"
