"""Eviction under pressure: a random stream of requests over more adapters of mixed ranks and
targets than the GPU pool holds. Every step, each running request's adapter (and the pinned one)
is resident in the slot it runs in, held; no write or clear touches the slot of an adapter in
use; and every resident adapter's rows still hold what was written into them. At the end every
request equals PEFT for its adapter and prompt, and none failed."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from conftest import peft_greedy, tiny_llama
from peft import PeftModel

from loramux import LoRARequest, SamplingParams
from loramux.engine.adapters.lora_model import LoRAModelManager
from loramux.engine.llm_engine import LLMEngine
from loramux.registry import LoRAConfig

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


class PoolWatch:
    """Wraps the engine's adapter weight pool: each write or clear of a slot that a running
    request (or a pin) uses is recorded as a violation, and each written slot's weights are kept
    to compare the pool against while that adapter stays resident."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng, self.manager = eng, eng.lora_manager
        self.pinned: dict[int, tuple[int, str]] = {}  # handle id -> (its slot, its name)
        self.violations: list[str] = []
        self.written: dict[int, list] = {}  # slot -> its weights right after its write
        pool = self.manager.pool
        write, clear = pool.write, pool.clear

        def watched_write(slot, modules):
            self._check_free(slot, "write")
            write(slot, modules)
            self.written[slot] = self.weights(slot)

        def watched_clear(slot):
            self._check_free(slot, "clear")
            clear(slot)

        pool.write, pool.clear = watched_write, watched_clear

    def pin(self, name: str) -> None:
        assert self.eng.pin_lora(name)
        handle_id = self.manager.handle(name).id
        self.pinned[handle_id] = (self.manager.slot_of(handle_id), name)

    def in_use(self) -> dict[int, str]:
        """Slot -> the adapter a running request or the pin uses there."""
        slots = {seq.lora_slot: seq.handle.name for seq in self.eng.scheduler.running if seq.handle is not None}
        slots.update(self.pinned.values())
        return slots

    def _check_free(self, slot: int, what: str) -> None:
        user = self.in_use().get(slot)
        if user is not None:
            self.violations.append(f"{what} of slot {slot}, which {user} uses")

    def weights(self, slot: int) -> list:
        """What the kernels read for ``slot`` in every layer (copies)."""
        return [(layer.slots.host_ranks[slot], layer.slots.scales[slot].clone(),
                 [(a.clone(), b.clone()) for a, b in layer.slots.slot_weights(slot)])
                for layer in self.manager.layers.values()]

    def check(self) -> None:
        """The invariants between two steps (see the module docstring)."""
        assert not self.violations, self.violations
        for seq in self.eng.scheduler.running:
            if seq.handle is not None:
                assert self.manager.slot_of(seq.handle.id) == seq.lora_slot, (seq.request_id, seq.handle.name)
                assert self.manager.is_held(seq.handle.id), (seq.request_id, seq.handle.name)
        for handle_id, (slot, name) in self.pinned.items():
            assert self.manager.slot_of(handle_id) == slot and self.manager.is_held(handle_id), name
        for layer in self.manager.layers.values():
            layer.slots.rows.check()
        for handle in self.manager.resident_handles():
            slot = self.manager.slot_of(handle.id)
            for (rank, scales, blocks), (rank0, scales0, blocks0) in zip(self.weights(slot), self.written[slot]):
                assert rank == rank0 and torch.equal(scales, scales0), f"{handle.name}'s slot changed"
                assert all(torch.equal(a, a0) and torch.equal(b, b0)
                           for (a, b), (a0, b0) in zip(blocks, blocks0)), f"{handle.name}'s rows changed"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eviction_under_pressure_keeps_running_adapters_and_equals_peft(make_adapter, async_scheduling):
    """8 adapters (rank 8 and 16; q/v and q/k/v/o), one pinned, in a pool of 32 rows a layer;
    40 requests (an adapter or none, 2-12 prompt tokens, 1-5 new ones) arrive over 40 steps, at
    most 4 running; steps launched in turn and ahead (async), which orders releases otherwise."""
    rng = random.Random(44)
    kinds = [(8, ["q_proj", "v_proj"]), (16, ["q_proj", "v_proj"]), (8, ATTENTION), (16, ATTENTION)]
    paths = {f"ev{i}": make_adapter(f"ev{i}", seed=400 + i, r=rank, lora_alpha=2 * rank, target_modules=targets)
             for i, (rank, targets) in enumerate(kinds * 2)}
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}
    # 32 rank rows a layer: two rank-16 adapters or four of rank 8, one of them pinned throughout
    probe = LoRAModelManager(tiny_llama(), LoRAConfig(max_lora_rank=16, max_gpu_lora_bytes=1 << 20))
    eng = LLMEngine(tiny_llama(), max_lora_rank=16, max_gpu_lora_bytes=32 * probe.pool.row_bytes,
                    max_num_seqs=4, max_model_len=32, async_scheduling=async_scheduling)
    assert eng.lora_manager.pool_units == 32
    for request in requests.values():  # all in host memory: the GPU pool is the pressure
        eng.add_lora(request)
    watch = PoolWatch(eng)
    watch.pin("ev0")

    arrivals: dict[int, list[tuple[str, str | None, list[int], int]]] = {}
    for i in range(40):
        name = rng.choice([*paths, None])
        prompt = [rng.randrange(3, 128) for _ in range(rng.randint(2, 12))]
        arrivals.setdefault(rng.randrange(40), []).append((f"req{i}", name, prompt, rng.randint(1, 5)))
    asked = {rid: (name, prompt) for batch in arrivals.values() for rid, name, prompt, _ in batch}

    finished: dict[str, list[int]] = {}
    fullest = 0.0
    for step in range(400):
        for rid, name, prompt, max_tokens in arrivals.get(step, []):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            eng.add_request(rid, {"prompt_token_ids": prompt}, params, requests.get(name))
        if step >= max(arrivals) and not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                assert out.error is None, (out.request_id, out.error)
                finished[out.request_id] = out.outputs[0].token_ids
        watch.check()
        fullest = max(fullest, eng.tier_stats()["gpu"].usage)

    assert finished.keys() == asked.keys()
    assert fullest == 1.0 and eng.lora_manager.stats.evictions >= 5  # the pool was under pressure
    by_adapter = defaultdict(list)
    for rid, (name, _) in asked.items():
        by_adapter[name].append(rid)
    for name, rids in by_adapter.items():  # one PEFT model per adapter
        oracle = tiny_llama() if name is None else PeftModel.from_pretrained(tiny_llama(), paths[name])
        for rid in rids:
            tokens = finished[rid]
            reference = peft_greedy(None, asked[rid][1], len(tokens), model=oracle)
            # transformers stops at end-of-sequence; the requests ignore it
            assert tokens[: len(reference)] == reference, (rid, name)
            assert len(reference) == len(tokens) or reference[-1] == 2, (rid, name)
