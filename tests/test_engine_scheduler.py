"""The scheduler alone: token budget, KV blocks, preemption, at most max_loras adapters per step, no starvation."""

from __future__ import annotations

import itertools

from loramux import LoRARequest, SamplingParams
from loramux.engine.adapters.uses import AdapterUses
from loramux.engine.core.block_manager import BlockManager
from loramux.engine.config import EngineConfig
from loramux.engine.core.scheduler import Scheduler
from loramux.engine.core.sequence import Sequence
from loramux.engine.core.step_outputs import ModelRunnerOutput, SchedulerOutput
from loramux.errors import CacheFullError
from loramux.registry import AdapterHandle

_arrivals = itertools.count()
_handles: dict[str, AdapterHandle] = {}  # one handle per adapter name, as a registry would issue


def handle(name: str) -> AdapterHandle:
    if name not in _handles:
        _handles[name] = AdapterHandle(len(_handles) + 1, name, f"digest-{name}", None, 8, 1024)
    return _handles[name]


def seq(name: str | None = None, prompt_len: int = 4, max_tokens: int = 3) -> Sequence:
    lora = None if name is None else LoRARequest(name, sum(map(ord, name)))
    return Sequence(
        request_id=f"r{next(_arrivals)}",
        prompt=None,
        prompt_token_ids=[5] * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        arrival=next(_arrivals),
        lora_request=lora,
        handle=None if name is None else handle(name),
    )


class Tiers(AdapterUses):
    """The counts, with the tiers' hooks given as functions (none: every adapter fits, in slot 0)."""

    def __init__(self, max_loras: int, **hooks) -> None:
        super().__init__(max_loras)
        for name, hook in hooks.items():
            assert hasattr(AdapterUses, f"_{name}"), name
            setattr(self, f"_{name}", hook)


def scheduler(rows: int = 4, budget: int = 64, max_loras: int = 1, blocks: int = 64,
              max_shared_prefill_tokens: int | None = None, **hooks) -> Scheduler:
    config = EngineConfig(max_num_seqs=rows, max_num_batched_tokens=budget, max_loras=max_loras, max_model_len=4096,
                          max_shared_prefill_tokens=max_shared_prefill_tokens, block_size=8)
    manager = BlockManager(blocks + 1, 8)  # block 0 is the scratch block
    return Scheduler(config, manager, adapters=Tiers(max_loras, **hooks))


def step(s: Scheduler) -> SchedulerOutput:
    """One step as the engine runs it, each sampled token a 7: schedule, launch, read back."""
    scheduled = s.schedule()
    sampled = [q for q, n in scheduled.chunks if q.num_computed + n == q.num_tokens]
    s.update_from_launch(scheduled, sampled)
    assert all(q.num_pending == 1 for q in sampled)
    s.update_from_output(ModelRunnerOutput(sampled, [7] * len(sampled)))
    return scheduled


def advance(s: Scheduler) -> list[Sequence]:
    """`step`; the sequences it ran."""
    return [q for q, _ in step(s).chunks]


def test_decodes_first_then_chunked_prefill_within_the_budget():
    s = scheduler(rows=3, budget=8, max_loras=2)
    a, b, c = seq(prompt_len=6), seq(prompt_len=6), seq(prompt_len=2)
    for q in (a, b, c):
        s.add(q)
    assert [(q, n) for q, n in s.schedule().chunks] == [(a, 6), (b, 2)]  # b's prompt is split
    a.num_computed, b.num_computed = 6, 2
    a.output_token_ids.append(1)
    assert [(q, n) for q, n in s.schedule().chunks] == [(a, 1), (b, 4), (c, 2)]
    assert len(s.running) == 3


def test_at_most_max_loras_adapters_per_step():
    s = scheduler(rows=8, max_loras=2)
    for name in ["x", "y", "z", "x", None]:
        s.add(seq(name))
    ran = [q.lora_name for q, _ in s.schedule().chunks]
    assert sorted(map(str, ran)) == ["None", "x", "x", "y"]
    # z waits; the x behind it shares x's slot, so it runs (a full batch); base goes ahead
    assert [q.lora_name for q in s.waiting] == ["z"]
    assert not s.draining  # x and y have no queued request: their slots free by themselves


def test_a_request_whose_adapter_is_not_resident_is_not_starved():
    """A steady stream of requests for the running adapter must not keep 'b' out forever."""
    s = scheduler(rows=4, max_loras=1)
    s.add(seq("a"))
    advance(s)
    blocked = seq("b")
    s.add(blocked)
    admitted_at = None
    for step in range(30):
        s.add(seq("a"))  # more work for the running adapter every step
        ran = advance(s)
        if blocked in ran:
            admitted_at = step
            break
        assert all(q.lora_name in ("a", None) for q in ran)
    assert admitted_at is not None and admitted_at < 10


def test_a_blocked_adapter_drains_the_least_queued_slot_while_the_other_keeps_running():
    """Two slots, streams of requests for both running adapters, then 'c': only the adapter with
    fewer queued requests drains (its new requests wait); the popular one keeps running every
    step; 'c' gets the drained slot within its requests' max_tokens, and the drained adapter
    comes back after 'c' (FIFO)."""
    s = scheduler(rows=16, max_loras=2)
    s.add(seq("popular"))
    s.add(seq("rare"))
    advance(s)
    c = seq("c")
    s.add(c)
    for _ in range(3):
        s.add(seq("popular"))
    s.add(seq("rare"))
    ran = advance(s)
    assert s.draining == {handle("rare").id}
    assert c not in ran and "rare" not in [q.lora_name for q in ran if q.num_computed <= 4]
    c_at = None
    for step in range(10):
        s.add(seq("popular"))
        s.add(seq("rare"))
        ran = advance(s)
        assert "popular" in [q.lora_name for q in ran]  # never held back: the batch stays full
        assert handle("popular").id not in s.draining
        if c in ran and c_at is None:
            c_at = step
    assert c_at is not None and c_at <= 3  # rare's running request had max_tokens=3
    assert any(q.lora_name == "rare" for q in s.running)  # rare came back once c had its slot


def test_blocked_adapters_take_freed_slots_oldest_first():
    s = scheduler(rows=16, max_loras=1)
    s.add(seq("a", max_tokens=2))
    advance(s)
    first, second = seq("b"), seq("c")
    s.add(first)
    s.add(second)
    order = []
    for _ in range(12):
        for q in advance(s):
            if q in (first, second) and q not in order:
                order.append(q)
    assert order == [first, second]


def test_a_failed_activation_fails_only_that_request():
    def activate(h):
        if h.name == "broken":
            raise CacheFullError("no room", adapter="broken")
        return 0

    ended, released = [], []
    s = scheduler(rows=4, max_loras=2, place=activate, ended=ended.append, released=released.append)
    ok, broken = seq("fine", max_tokens=1), seq("broken")
    s.add(broken)
    s.add(ok)
    assert step(s).failed == [broken] and broken.finish_reason == "error"
    assert ok.is_finished and ended == [handle("fine")] and not s.adapters
    assert released == [handle("broken"), handle("fine")]  # each reference released exactly once
    assert s.blocks.num_free_blocks == 64  # every block came back


def test_reference_counts_follow_queue_run_preempt_and_finish():
    """The one owner of "in use": a reference per queued or running sequence, a slot while one
    runs; the tier callbacks fire on the transitions only."""
    calls = []
    s = scheduler(rows=4, max_loras=2, referenced=lambda h: calls.append(("ref", h.name)),
                  place=lambda h: calls.append(("start", h.name)) or 1,
                  ended=lambda h: calls.append(("end", h.name)),
                  released=lambda h: calls.append(("release", h.name)))
    a1, a2 = seq("a", max_tokens=2), seq("a", max_tokens=4)
    s.add(a1)
    s.add(a2)
    assert calls == [("ref", "a")] and s.adapters.references(handle("a").id) == 2
    advance(s)
    assert calls == [("ref", "a"), ("start", "a")] and a1.lora_slot == a2.lora_slot == 1
    s._preempt(a2)  # back to the queue: keeps its reference, gives up its slot use
    assert a2.lora_slot == -1 and s.adapters.running(handle("a").id) == 1
    while s.has_work():
        advance(s)
    assert calls[-2:] == [("end", "a"), ("release", "a")] and not s.adapters


def test_pinned_adapters_hold_slots_and_skip_the_queue():
    s = scheduler(rows=8, max_loras=2)
    s.adapters.pin(handle("pinned"))
    s.add(seq("a"))
    advance(s)  # 'a' runs: both slots are in use now
    blocked, pinned_request = seq("b"), seq("pinned")
    s.add(blocked)
    s.add(pinned_request)
    ran = advance(s)
    assert pinned_request in ran and blocked not in ran
    while any(q.lora_name == "a" for q in s.running):
        advance(s)
    s.adapters.pin(handle("other"))  # every slot pinned: a request for another adapter fails
    advance(s)
    assert blocked.finish_reason == "error" and isinstance(blocked.error, CacheFullError)
    s.adapters.unpin(handle("other"))
    assert s.adapters.references(handle("other").id) == 0 and s.adapters.references(handle("pinned").id) >= 1


def test_api_requests_are_admitted_in_turns():
    """A request of many prompts does not hold up one that arrives after it: each round admits one
    sequence of every API request, and each request's own sequences keep their order."""
    s = scheduler(rows=4, budget=64, blocks=64)
    big = [seq(max_tokens=1) for _ in range(10)]
    for q in big:
        q.api_request_id = "big"
        s.add(q)
    small = seq(max_tokens=1)
    small.api_request_id = "small"
    s.add(small)
    assert list(s.in_turn()) == [big[0], small, *big[1:]]
    assert advance(s) == [big[0], small, big[1], big[2]]  # the small one runs in the first step
    # a request arriving while the big one runs comes first in the next step: it was never admitted
    late = seq(max_tokens=1)
    late.api_request_id = "late"
    s.add(late)
    assert advance(s) == [late, big[3], big[4], big[5]]
    admitted = [q for _ in range(2) for q in advance(s)]
    assert admitted == big[6:]  # nothing was lost, and the big request's order held
    assert not s.has_work()


def test_turns_carry_over_steps_when_one_row_frees_at_a_time():
    """One row frees per step: the request admitted least recently takes it, so a small request
    is not passed over every time by the big one's next sequence."""
    s = scheduler(rows=2, budget=64)
    big = [seq(max_tokens=10 if i == 1 else 2) for i in range(6)]
    for q in big:
        q.api_request_id = "big"
        s.add(q)
    assert advance(s) == big[:2]
    small = seq(max_tokens=1)
    small.api_request_id = "small"
    s.add(small)
    assert advance(s) == big[:2]  # both decode; big[0] ends, one row frees
    assert advance(s) == [big[1], small]  # the small request takes it, not big[2]


def test_sequences_without_an_api_request_are_first_come_first_served():
    s = scheduler(rows=2, budget=64)
    queued = [seq(max_tokens=1) for _ in range(5)]
    for q in queued:
        s.add(q)
    assert list(s.in_turn()) == queued


def test_a_step_shared_by_api_requests_carries_few_prompt_tokens_beside_the_decodes():
    s = scheduler(rows=4, budget=64, max_shared_prefill_tokens=6)
    talker = seq(prompt_len=4, max_tokens=5)
    talker.api_request_id = "talker"
    s.add(talker)
    advance(s)  # its prompt, alone: no bound
    bulk = [seq(prompt_len=10, max_tokens=1) for _ in range(3)]
    for q in bulk:
        q.api_request_id = "bulk"
        s.add(q)
    chunks = s.schedule().chunks
    assert chunks[0] == (talker, 1) and sum(n for q, n in chunks[1:]) == 6  # its decode, and 6 prompt tokens
    alone = scheduler(rows=4, budget=64, max_shared_prefill_tokens=6)
    for q in [seq(prompt_len=10) for _ in range(3)]:  # one API request (or none): the whole budget
        q.api_request_id = "bulk"
        alone.add(q)
    assert alone.schedule().num_tokens == 30
