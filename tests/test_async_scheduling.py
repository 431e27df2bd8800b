"""Async scheduling: the engine launches a step before it reads the last one's tokens back (their
ids reach the next step on the device), and its outputs are the synchronous engine's, token for
token, whatever ends a request (a stop token or string, max_tokens, an abort), with adapters,
chunked prefill, preemption, logprobs, seeds, penalties and prefix caching."""

from __future__ import annotations

import pytest
import torch
from conftest import char_tokenizer, peft_greedy, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.worker.model_runner import LaunchedStep

GREEDY = dict(temperature=0, ignore_eos=True)


def engine(async_scheduling: bool, **kwargs) -> LLMEngine:
    options = dict(max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16,
                   block_size=8, tokenizer=char_tokenizer(), async_scheduling=async_scheduling)
    options.update(kwargs)
    return LLMEngine(tiny_llama(), **options)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


def serve(eng: LLMEngine, requests: list[tuple], abort_at: dict[str, int] | None = None, max_steps: int = 500):
    """Add ``(request id, prompt, params, adapter or None)`` each, step until none is left
    (aborting ``abort_at``'s requests at those steps); every request's last output. The KV cache
    is whole again at the end, and its bookkeeping consistent."""
    for request_id, prompt, params, lora in requests:
        eng.add_request(request_id, {"prompt_token_ids": prompt}, params, lora)
    last = {}
    for step in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for request_id, at in (abort_at or {}).items():
            if at == step:
                eng.abort_request(request_id)
        for out in eng.step():
            last[out.request_id] = out
    assert not eng.has_unfinished_requests()
    blocks = eng.block_manager
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks and not eng.scheduler.running
    return last


def summary(outputs, expected: bool = False) -> dict[str, tuple]:
    """Each request's tokens, text, finish and stop reasons, and logprobs; the ``expected`` side
    compares logprob values to 1e-5 (token ids and ranks exactly): adapters load on a thread, so
    the two engines may batch a step's rows differently, and a CPU matmul's last bits depend on
    the batch's rows."""
    def logprobs(out):
        return None if out.logprobs is None else [
            {token: (lp.rank, pytest.approx(lp.logprob, abs=1e-5) if expected else lp.logprob)
             for token, lp in position.items()} for position in out.logprobs]

    return {rid: (out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason,
                  out.outputs[0].stop_reason, logprobs(out.outputs[0])) for rid, out in outputs.items()}


def test_async_outputs_equal_sync_for_every_way_a_request_ends(engine_adapters):
    """More requests than rows, adapters and base rows, chunked prefill; requests ending on a stop
    token (its step's successor already launched: that row is dropped), a stop string, min_tokens
    holding a stop back, max_tokens, max_model_len; seeded sampling with logprobs; a penalty (its
    sampling reads the tokens on the host: those steps wait for them)."""
    attn = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    everything = LoRARequest("all", 2, str(engine_adapters["all"]))
    p = prompts(9, 30, 5, 14, 21, 7, 11, 40, seed=3)
    free = {rid: out.outputs[0].token_ids for rid, out in serve(engine(False), [
        ("base", p[0], SamplingParams(max_tokens=12, **GREEDY), None),
        ("all", p[1], SamplingParams(max_tokens=12, **GREEDY), everything),
        ("attn", p[3], SamplingParams(max_tokens=12, **GREEDY), attn),
    ]).items()}
    text = char_tokenizer().decode(free["all"][4:6])
    requests = [
        ("stop-token", p[0], SamplingParams(max_tokens=12, stop_token_ids=[free["base"][3]], **GREEDY), None),
        ("stop-string", p[1], SamplingParams(max_tokens=12, stop=[text], **GREEDY), everything),
        ("held-back", p[3], SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=[free["attn"][1]], **GREEDY),
         attn),
        ("length", p[2], SamplingParams(max_tokens=9, **GREEDY), attn),
        ("model-len", p[7], SamplingParams(max_tokens=80, **GREEDY), None),
        ("seeded", p[4], SamplingParams(temperature=0.8, seed=7, max_tokens=10, logprobs=3, ignore_eos=True),
         everything),
        ("penalised", p[5], SamplingParams(repetition_penalty=1.5, max_tokens=10, **GREEDY), attn),
        ("eos", p[6], SamplingParams(temperature=0, max_tokens=30), None),
    ]
    sync = summary(serve(engine(False), requests), expected=True)
    eng = engine(True)
    outputs = serve(eng, requests)
    assert summary(outputs) == sync
    reasons = {rid: out.outputs[0].finish_reason for rid, out in outputs.items()}
    assert reasons["stop-token"] == reasons["stop-string"] == reasons["held-back"] == "stop"
    assert reasons["length"] == reasons["model-len"] == "length"
    assert len(outputs["stop-token"].outputs[0].token_ids) == 4 and len(outputs["held-back"].outputs[0].token_ids) >= 6
    assert len(outputs["model-len"].outputs[0].token_ids) == 96 - len(p[7])
    assert len(outputs["seeded"].outputs[0].logprobs) == 10
    assert outputs["length"].outputs[0].token_ids == peft_greedy(engine_adapters["attn"], p[2], 9)


def test_async_equals_sync_under_preemption_and_aborts(engine_adapters):
    """A KV cache too small for the batch preempts sequences whose last token is still on the
    device (they are readmitted once it arrives); aborts land while their step runs."""
    attn = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    p = prompts(20, 25, 17, 30, 12, 22, seed=8)
    requests = [(f"r{i}", prompt, SamplingParams(max_tokens=24, **GREEDY), attn if i % 2 else None)
                for i, prompt in enumerate(p)]
    kwargs = dict(num_gpu_blocks_override=17)
    sync_engine, async_engine = engine(False, **kwargs), engine(True, **kwargs)
    sync, outputs = summary(serve(sync_engine, requests), expected=True), summary(serve(async_engine, requests))
    assert outputs == sync and async_engine.scheduler.num_preemptions > 0
    assert all(len(tokens) == 24 for tokens, *_ in outputs.values())
    aborted = serve(engine(True, **kwargs), requests, abort_at={"r1": 3, "r4": 9})
    for rid, out in aborted.items():
        if rid in ("r1", "r4"):
            assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 24
        else:
            assert summary({rid: out})[rid] == sync[rid]


def launch_and_read_order(async_scheduling: bool, params: SamplingParams, monkeypatch) -> list[str]:
    eng = engine(async_scheduling)
    events = []
    run = eng.runner.execute_model
    monkeypatch.setattr(eng.runner, "execute_model", lambda batch: events.append("launch") or run(batch))
    monkeypatch.setattr(LaunchedStep, "token_ids", lambda step, _read=LaunchedStep.token_ids: (
        events.append("read") or _read(step)))
    serve(eng, [("a", prompts(5)[0], params, None)])
    return events


def test_a_step_is_launched_before_the_last_ones_tokens_are_read(monkeypatch):
    """Async: launch, launch, read, launch, read, ... (the host's work between steps overlaps the
    GPU's). Synchronous, or a request whose sampling reads its tokens on the host: launch, read."""
    plain = SamplingParams(max_tokens=5, **GREEDY)
    assert launch_and_read_order(True, plain, monkeypatch) == ["launch"] + ["launch", "read"] * 4 + ["read"]
    assert launch_and_read_order(False, plain, monkeypatch) == ["launch", "read"] * 5
    penalised = SamplingParams(max_tokens=5, presence_penalty=0.5, **GREEDY)
    assert launch_and_read_order(True, penalised, monkeypatch) == ["launch", "read"] * 5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_next_turn_hits_every_block_the_last_one_computed(async_scheduling):
    """A request's last computed token completes a block (13 prompt + 12 generated tokens, 24
    computed, blocks of 8): the next turn (its tokens and more) finds all 3 blocks cached, though
    async scheduling decoded that token while its id was still on the device."""
    eng = engine(async_scheduling)
    prompt = prompts(13)[0]
    first = serve(eng, [("turn-1", prompt, SamplingParams(max_tokens=12, **GREEDY), None)])
    history = prompt + first["turn-1"].outputs[0].token_ids
    hits = eng.block_manager.stats.hits
    serve(eng, [("turn-2", history + [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), None)])
    assert eng.block_manager.stats.hits - hits == 24


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_each_step_schedules_once_and_the_scheduler_alone_counts_computed_tokens(async_scheduling, make_adapter,
                                                                                monkeypatch):
    """schedule -> execute -> update: one schedule per step, also in the steps that launch nothing
    (a request waiting for its adapter's copy, the last tokens of a batch); a sequence's computed
    tokens move only in the scheduler's update, after its step's launch."""
    eng = engine(async_scheduling)
    lora = LoRARequest("late", 1, str(make_adapter("late", seed=3)))
    calls, updates = [], []
    schedule, update = eng.scheduler.schedule, eng.scheduler.update_from_launch
    monkeypatch.setattr(eng.scheduler, "schedule", lambda: calls.append("schedule") or schedule())

    def checked_update(scheduled, sampled):
        computed = [seq.num_computed for seq, _ in scheduled.chunks]
        update(scheduled, sampled)
        updates.append([seq.num_computed - before for (seq, _), before in zip(scheduled.chunks, computed)])

    monkeypatch.setattr(eng.scheduler, "update_from_launch", checked_update)
    steps = []
    eng.add_step_listener(lambda timings: steps.append(calls.count("schedule")) or calls.clear())
    last = serve(eng, [("base", prompts(20)[0], SamplingParams(max_tokens=6, **GREEDY), None),
                       ("lora", prompts(5)[0], SamplingParams(max_tokens=4, **GREEDY), lora)])
    assert {out.outputs[0].finish_reason for out in last.values()} == {"length"}
    assert steps and set(steps) == {1}
    assert [n for step in updates for n in step] and all(n >= 1 for step in updates for n in step)
    assert sum(n for step in updates for n in step) == 20 + 5 + 5 + 3  # prompts, then one decode a token
