"""Issue 13 on the GPU: a LoRA step captured in a CUDA graph with every projection's shrink on the
side stream replays what the eager step and the sequential path (shrink after the base GEMM)
compute. Run on the GPU machine: ``pytest -m gpu tests/test_layer_side_stream_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

import loramux.engine.layers.base as base_module
from loramux.engine.lora_model import LoRAModelManager
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
def test_a_captured_step_with_the_shrink_beside_the_base_gemm_equals_eager_and_sequential(
        engine_adapters, monkeypatch):
    """bfloat16. Each comparison is exact: the same kernels run on the same inputs with the same
    launch shapes (one static meta), only the stream the shrink runs on differs, and a row's
    values never depend on its neighbours'. A missing join would let the expand read the buf of
    the previous replay, which held another mapping's adapters."""
    monkeypatch.delenv("LORAMUX_KERNELS", raising=False)  # the Triton kernels: the side stream applies
    device = torch.device("cuda")
    assert base_module.shrink_beside_base(device)
    model = tiny_llama().to(device, torch.bfloat16)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8))
    for name in ("attn", "all"):
        manager.activate(load_adapter(engine_adapters[name], name=name))
    ids = torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(3)).to(device)
    slots = manager.token_slots(MAPPINGS["mixed"], S)  # [B*S] int32: the graph's static input

    forks = []
    real_side_stream = base_module.side_stream
    monkeypatch.setattr(base_module, "side_stream", lambda dev: forks.append(dev) or real_side_stream(dev))

    real_shrink_beside_base = base_module.shrink_beside_base

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
        monkeypatch.setattr(base_module, "shrink_beside_base", lambda dev: False)
        try:
            return step()
        finally:
            monkeypatch.setattr(base_module, "shrink_beside_base", real_shrink_beside_base)

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
    assert forks, "no projection forked its shrink while the graph was captured"

    for label, names in MAPPINGS.items():
        slots.copy_(manager.token_slots(names, S))
        graph.replay()
        got = replayed.clone()
        eager = step()
        in_order = sequential()
        manager.set_mapping(None)
        torch.testing.assert_close(eager, in_order, rtol=0, atol=0, msg=f"{label}: eager != sequential")
        torch.testing.assert_close(got, eager, rtol=0, atol=0, msg=f"{label}: replay != eager")
        for row, name in enumerate(names):
            if name is None:  # base rows are left exactly as the base model computes them
                torch.testing.assert_close(got[row], base_out[row], rtol=0, atol=0, msg=f"{label}: row {row}")
            else:
                assert (got[row] - base_out[row]).abs().max() > 0.01, f"{label}: adapter row {row} unchanged"
