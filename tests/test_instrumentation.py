"""The engine's named timing points (`loramux.engine.core.instrumentation`): what a step listener is
told, that each forward is reported once from launch to read, that an unknown point is an error,
and that without a listener the points read no clock."""

from __future__ import annotations

import pytest
from conftest import step_to_end, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.core import instrumentation
from loramux.engine.core.instrumentation import POINTS, StepTimings
from loramux.engine.llm_engine import LLMEngine

TOP_LEVEL = ("collect", "prefetch", "schedule", "forward", "receive")  # not nested in one another


def engine(**options) -> LLMEngine:
    return LLMEngine(tiny_llama(), max_loras=1, max_lora_rank=8, max_cpu_loras=4, max_num_seqs=4, max_model_len=48,
                     max_num_batched_tokens=16, **options)


def add_requests(llm: LLMEngine, adapters: dict, n: int, prompt_len: int = 10, max_tokens: int = 4) -> None:
    names = [None, *adapters]
    for i in range(n):
        name = names[i % len(names)]
        lora = None if name is None else LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name]))
        prompt = {"prompt_token_ids": [1 + (i * 7 + j) % 120 for j in range(prompt_len)]}
        llm.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), lora)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_listener_gets_every_steps_points_and_every_forward_once(engine_adapters, async_scheduling):
    """Two adapters over one GPU slot (placements and evictions), prompts longer than a step's
    token budget (chunked prefill mixed with decodes): each forward launched is read back once,
    in launch order, after its launch; the points nest inside the step's wall time."""
    llm = engine(async_scheduling=async_scheduling)
    seen: list[StepTimings] = []
    llm.add_step_listener(seen.append)
    add_requests(llm, {k: engine_adapters[k] for k in ("attn", "all")}, n=6)
    step_to_end(llm)

    assert seen and all(set(t.phases) <= set(POINTS) for t in seen)
    for t in seen:
        assert sum(t.phase(name) for name in TOP_LEVEL) <= t.seconds + 1e-6
        assert t.phase("lora.place") <= t.phase("prefetch") + t.phase("schedule") + 1e-6
        assert (t.launched is not None) == (t.phase("forward") > 0)
    launched = [t.launched for t in seen if t.launched is not None]
    received = [b for t in seen for b in t.received]
    assert [(b.launched_at, b.num_tokens) for b in received] == [(b.launched_at, b.num_tokens) for b in launched]
    assert all(b.launched_at < b.received_at for b in received)
    # every token was computed in a reported forward: 6 prompts of 10 tokens and 3 decodes each
    assert sum(b.num_tokens for b in launched) == 6 * (10 + 3)
    assert sum(b.prompt_tokens for b in launched) == 6 * 10
    assert max(b.num_tokens for b in launched) <= 16 and all(b.kv_tokens >= b.num_tokens for b in launched)
    assert sum(t.phase("lora.place") > 0 for t in seen) >= 2  # two adapters took the one slot in turn
    assert any(t.phase("lora.can_place") > 0 for t in seen)
    read_in_own_step = [any(b.launched_at == t.launched.launched_at for b in t.received)
                        for t in seen if t.launched is not None]
    # async: a forward's tokens are mostly read in the step after the one that launched it
    assert all(read_in_own_step) is not async_scheduling


def test_an_unknown_point_is_an_error_naming_the_points():
    timings = StepTimings(started=0.0, seconds=0.0)
    assert timings.phase("schedule") == 0.0  # a point the step did not reach
    with pytest.raises(ValueError, match="'shedule' is not a timing point.*collect, prefetch, schedule"):
        timings.phase("shedule")
    llm = engine(enable_lora=False)
    with pytest.raises(ValueError, match="'_write_slot' is not a timing point"):
        llm.clock["_write_slot"]


def test_without_a_listener_no_clock_is_read_and_a_removed_one_hears_nothing(monkeypatch):
    llm = engine(enable_lora=False)
    calls = []
    heard = []
    llm.add_step_listener(heard.append)
    llm.remove_step_listener(heard.append)
    monkeypatch.setattr(instrumentation.time, "perf_counter", lambda: calls.append(1) or 0.0)
    add_requests(llm, {}, n=3)
    step_to_end(llm)
    assert calls == [] and heard == [] and not llm.clock.on


def test_a_listener_added_while_a_forward_is_in_flight_is_told_only_what_it_saw_launch():
    llm = engine(enable_lora=False, async_scheduling=True)
    add_requests(llm, {}, n=2, max_tokens=6)
    llm.step()  # launches the first forward (async: its tokens are read in the next step)
    seen: list[StepTimings] = []
    llm.add_step_listener(seen.append)
    step_to_end(llm)
    assert not seen[0].received and seen[0].launched is not None
    assert [b.launched_at for t in seen for b in t.received] == [t.launched.launched_at for t in seen if t.launched]


def test_a_listener_that_raises_leaves_step():
    llm = engine(enable_lora=False)

    def broken(timings):
        timings.phase("lora.slot_write")

    llm.add_step_listener(broken)
    add_requests(llm, {}, n=1)
    with pytest.raises(ValueError, match="'lora.slot_write' is not a timing point"):
        llm.step()
