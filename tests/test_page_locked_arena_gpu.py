"""The page-locked arena on CUDA: its pieces are page-locked memory, loads while serving allocate
none, and a piece whose adapter left the CPU tier waits for the slot write still copying from it.
Run on the GPU machine: ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from conftest import peft_greedy, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.registry import LoRAConfig, Registry
from loramux.registry.page_locked_arena import PageLockedArena

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def engine(**kwargs):
    from loramux.engine.llm_engine import LLMEngine

    options = dict(max_loras=1, max_lora_rank=8, max_cpu_loras=1, max_num_seqs=4, max_model_len=64,
                   num_gpu_blocks_override=256, enforce_eager=True)
    return LLMEngine(tiny_llama().cuda(), **{**options, **kwargs})


def host_allocations() -> int:
    """Page-locked allocations PyTorch's host allocator made (cudaHostAlloc) so far."""
    return torch.cuda.host_memory_stats()["num_host_alloc"]


def test_pieces_are_page_locked_and_copy_asynchronously():
    arena = PageLockedArena(64 << 20)
    piece = arena.allocate(10 << 20)
    assert piece.is_pinned() and piece[4096:].is_pinned() and arena.owns(piece)
    device = torch.empty(piece.numel(), dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(200_000_000)  # the stream is busy: an asynchronous copy returns at once
    device.copy_(piece, non_blocking=True)
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()


def test_the_engine_serves_from_its_arena_and_loads_allocate_no_page_locked_memory(engine_adapters):
    eng = engine()
    arena = eng.registry.host_memory
    assert isinstance(arena, PageLockedArena) and eng.lora_manager.on_host_copies == arena.fence
    before = host_allocations()
    names = ["attn", "all", "mlp"]
    for number, name in enumerate(names * 2, start=1):  # a tier of one: every load is a cold one
        adapter = eng.registry.get(LoRARequest(name, number, str(engine_adapters[name])))
        assert adapter.is_pinned and all(arena.owns(w.lora_a) for w in adapter.modules.values())
    assert host_allocations() == before
    assert arena.stats.fallbacks == 0 and arena.stats.pieces <= 2  # the evicted ones came back
    prompt = [5, 17, 3, 9, 30]
    # no ignore_eos: the oracle's greedy generate stops at the end-of-sequence token too
    eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8),
                    LoRARequest("all", 99, str(engine_adapters["all"])))
    finished = []
    while eng.has_unfinished_requests():
        finished += [out for out in eng.step() if out.finished]
    assert finished[0].outputs[0].token_ids == peft_greedy(engine_adapters["all"], prompt, 8)


def test_a_piece_still_being_copied_from_is_not_reused(engine_adapters):
    eng = engine()
    arena = eng.registry.host_memory
    adapter = eng.registry.get(LoRARequest("attn", 1, str(engine_adapters["attn"])))
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU work ahead of the slot write's copies
    eng.lora_manager.activate(adapter)
    in_use = arena.stats.in_use_bytes
    assert in_use > 0
    del adapter
    eng.registry.unregister("attn")  # out of the CPU tier: nothing on the host references it
    eng.lora_manager.deactivate("attn")
    assert arena.stats.in_use_bytes == in_use  # its copy may still read it
    torch.cuda.synchronize()
    assert arena.stats.in_use_bytes == 0


def test_a_registry_with_its_own_arena_keeps_it_in_the_engine():
    arena = PageLockedArena(32 << 20)
    registry = Registry(LoRAConfig(max_loras=1, max_lora_rank=8), resolvers=[], host_memory=arena)
    eng = engine(registry=registry)
    assert eng.registry.host_memory is arena and eng.lora_manager.on_host_copies == arena.fence
