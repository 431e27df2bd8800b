"""Overlap loading with compute on CPU: a queued request's adapter is copied
into a free GPU slot before its request is admitted, and a prefetch never evicts a slot in use."""

from __future__ import annotations

from conftest import peft_greedy, step_to_end, tiny_llama

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.worker.model_runner import LaunchedStep
from loramux.engine.core.sequence import SequenceStatus

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [(7 * i) % 120 + 3 for i in range(9)]


def engine(**kwargs) -> LLMEngine:
    options = dict(max_lora_rank=8, max_model_len=64)
    options.update(kwargs)
    return LLMEngine(tiny_llama(), **options)


def start_one_then_queue_another(eng, adapters, first: tuple[str, str], second: tuple[str, str]) -> None:
    """(request id, adapter) each: the first runs 40 tokens (outlasting the other's load) before the
    second arrives, whichever load ends first."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request(first[0], {"prompt_token_ids": PROMPT}, long, LoRARequest(first[1], 1, str(adapters[first[1]])))
    for _ in range(100):
        if eng._requests[first[0]].status is SequenceStatus.RUNNING:
            break
        eng.step()
    eng.add_request(second[0], {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest(second[1], 2, str(adapters[second[1]])))


def test_a_queued_requests_adapter_is_in_a_slot_before_it_is_admitted(engine_adapters):
    """One row: 'second' queues behind 'first'; a free slot takes its adapter while it waits."""
    eng = engine(max_loras=2, max_num_seqs=1)
    start_one_then_queue_another(eng, engine_adapters, ("first", "attn"), ("second", "mlp"))
    seen_waiting_in_slot = []

    def watch():
        seq = eng._requests.get("second")
        if seq is not None and seq.status is SequenceStatus.WAITING and seq.handle is not None:
            seen_waiting_in_slot.append(eng.lora_manager.slot_of(seq.handle.id) is not None)

    finished = step_to_end(eng, max_steps=300, each_step=watch)
    assert seen_waiting_in_slot and all(seen_waiting_in_slot)
    assert eng.adapters.prefetches >= 1
    assert finished["first"] == peft_greedy(engine_adapters["attn"], PROMPT, 40)
    assert finished["second"] == peft_greedy(engine_adapters["mlp"], PROMPT, 6)


def test_an_engine_at_rest_runs_a_request_in_the_step_that_collects_its_adapter(engine_adapters):
    """Nothing runs, nothing is in flight: the copy comes before scheduling, so the request whose
    adapter just loaded is admitted (and, on the CPU, gets its first token) in that very step,
    not one step later; again for a second adapter once the engine is at rest again."""
    import threading

    eng = engine(max_loras=2)
    for number, name in enumerate(("attn", "mlp"), start=1):
        ready = threading.Event()
        eng.add_event_listener(lambda event, _ready=ready: event.kind == "ready" and _ready.set())
        eng.add_request(name, {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest(name, number, str(engine_adapters[name])))
        assert ready.wait(30)  # loaded beside the loop
        outputs = {out.request_id: out for out in eng.step()}
        assert outputs[name].outputs[0].token_ids == peft_greedy(engine_adapters[name], PROMPT, 1)
        finished = step_to_end(eng)
        assert finished[name] == peft_greedy(engine_adapters[name], PROMPT, 6)
    assert eng.adapters.prefetches == 2


def test_a_prefetch_never_evicts_a_slot_in_use(engine_adapters):
    """One slot, held by the running request: the queued adapter waits for it instead."""
    eng = engine(max_loras=1, max_cpu_loras=2, max_num_seqs=2)  # room to prefetch into the CPU tier
    start_one_then_queue_another(eng, engine_adapters, ("running", "attn"), ("queued", "all"))
    checks = []

    def watch():
        running, queued = eng._requests.get("running"), eng._requests.get("queued")
        if running is not None and running.status is SequenceStatus.RUNNING and queued.handle is not None:
            checks.append(eng.lora_manager.slot_of(running.handle.id) == running.lora_slot
                          and eng.lora_manager.slot_of(queued.handle.id) is None)

    finished = step_to_end(eng, max_steps=300, each_step=watch)
    assert checks and all(checks)
    assert eng.lora_manager.stats.evictions == 1  # 'running' left only once its request ended
    assert finished["running"] == peft_greedy(engine_adapters["attn"], PROMPT, 40)
    assert finished["queued"] == peft_greedy(engine_adapters["all"], PROMPT, 6)


def test_a_step_copies_at_most_a_few_adapters_ahead(engine_adapters, monkeypatch):
    """Many free slots and many queued adapters in host memory: the copies spread over steps
    (one step placing every queued adapter stalled a trace of 1,000 adapters for 1.5 s), and every
    request still gets its adapter's output."""
    from loramux.engine.adapters import lifecycle

    monkeypatch.setattr(lifecycle, "PREFETCH_PER_STEP", 2)
    eng = engine(max_loras=8, max_cpu_loras=8, max_num_seqs=1)
    names = [f"attn{i}" for i in range(7)]  # one file, seven names: seven handles, seven slots
    start_one_then_queue_another(eng, engine_adapters, ("first", "attn"), ("second", "attn"))
    for i, name in enumerate(names):
        eng.add_request(name, {"prompt_token_ids": PROMPT}, GREEDY,
                        LoRARequest(name, 10 + i, str(engine_adapters["attn"])))
    per_step, placed = [], []
    real = eng.lora_manager.prefetch
    monkeypatch.setattr(eng.lora_manager, "prefetch", lambda adapter, keep=(): placed.append(adapter.name) or real(
        adapter, keep=keep))

    def watch():
        per_step.append(len(placed))
        placed.clear()

    finished = step_to_end(eng, max_steps=500, each_step=watch)
    per_step.append(len(placed))
    assert max(per_step) <= 2 and sum(per_step) >= 5  # seven queued adapters, over several steps
    expected = peft_greedy(engine_adapters["attn"], PROMPT, 6)
    assert all(finished[name] == expected for name in names + ["second"])


def test_the_prefetch_runs_while_a_step_computes(engine_adapters, monkeypatch):
    """Its host work hides behind a step's GPU work: every prefetch runs after some step was
    launched and before that step's tokens are read back (on an H100 with 1,000 adapters it had
    cost 10.6 ms of a 23.5 ms decode step, before the forward). With async scheduling it runs
    before the next step is scheduled (while the last one computes), so a request whose adapter
    it copies is admitted in the same step; without, beside the step launched, and the request
    is admitted at the next."""
    events = []
    monkeypatch.setattr(LaunchedStep, "token_ids", lambda step, _read=LaunchedStep.token_ids: (
        events.append("read") or _read(step)))
    for async_scheduling in (True, False):
        # one slot: 'second' waits for 'first' to end, then for the copy of its adapter, while a
        # base request keeps every step busy
        eng = engine(max_loras=1, max_num_seqs=3, async_scheduling=async_scheduling)
        eng.add_request("base", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=80,
                                                                             ignore_eos=True))
        start_one_then_queue_another(eng, engine_adapters, ("first", "attn"), ("second", "mlp"))
        events.clear()
        runner, adapters = eng.runner, eng.adapters
        real_run, real_prefetch = runner.execute_model, adapters.prefetch
        monkeypatch.setattr(runner, "execute_model", lambda batch, _run=real_run: events.append("run") or _run(batch))
        monkeypatch.setattr(adapters, "prefetch", lambda *a, _prefetch=real_prefetch, **kw: (
            events.append("prefetch") or _prefetch(*a, **kw)))
        launched_before = int(eng._in_flight is not None)  # a step launched before the recording
        admitted = []  # whether 'second' runs once its adapter is copied
        copies = adapters.prefetches

        def watch():
            if adapters.prefetches > copies and not admitted:
                admitted.append(eng._requests["second"].status is SequenceStatus.RUNNING)

        finished = step_to_end(eng, max_steps=300, each_step=watch)
        in_flight = launched_before  # launched steps whose tokens are not read yet, at each prefetch
        at_prefetch = []
        for event in events:
            in_flight += {"run": 1, "read": -1}.get(event, 0)
            if event == "prefetch":
                at_prefetch.append(in_flight)
        steps_beside = sum(n >= 1 for n in at_prefetch)
        assert steps_beside >= 20 and steps_beside >= len(at_prefetch) - 3, at_prefetch  # (the tail's steps: none)
        assert eng.adapters.prefetches >= 1  # 'second' took its slot ahead of its admission
        assert admitted == [async_scheduling]  # async: admitted in the step that copied its adapter
        assert finished["second"] == peft_greedy(engine_adapters["mlp"], PROMPT, 6)


def test_admission_copies_no_adapter_the_prefetch_does(engine_adapters, monkeypatch):
    """Every slot write happens beside a step (the prefetch), none in ``schedule``: a request whose
    adapter has room but no slot waits a step for the copy, so no step's forward waits on the host
    work of placing adapters (on an H100 those placements made a 1,000-adapter trace's slowest
    steps, 52-103 ms). Every request still gets its adapter's output."""
    eng = engine(max_loras=8, max_cpu_loras=8, max_num_seqs=4)
    start_one_then_queue_another(eng, engine_adapters, ("first", "attn"), ("second", "attn"))
    names = queue_mlp_requests(eng, engine_adapters, 6)
    inside, writes = [], []  # the methods each slot write ran inside
    for owner, method in ((eng.scheduler, "schedule"), (eng.adapters, "prefetch")):
        def entered(*args, _real=getattr(owner, method), _name=method, **kwargs):
            inside.append(_name)
            try:
                return _real(*args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(owner, method, entered)
    real_write = eng.lora_manager._write_slot
    monkeypatch.setattr(eng.lora_manager, "_write_slot", lambda *a: writes.append(tuple(inside)) or real_write(*a))
    finished = step_to_end(eng, max_steps=300)
    assert writes == [("prefetch",)] * len(names)  # ('second' runs on the adapter of 'first', placed before)
    expected = peft_greedy(engine_adapters["mlp"], PROMPT, 6)
    assert all(finished[name] == expected for name in names)
    assert finished["second"] == peft_greedy(engine_adapters["attn"], PROMPT, 6)


def test_past_one_copy_a_prefetch_goes_on_only_while_the_gpu_computes(engine_adapters):
    """Its host work hides behind the step's GPU work until that ends (the runner's `computing`,
    which the engine passes on CUDA): then one copy a step, no more; with nothing to hide behind
    (None: the CPU, a step with nothing to run) the per-step cap alone bounds it."""
    from loramux.engine.adapters.lifecycle import PREFETCH_PER_STEP

    eng = engine(max_loras=20, max_cpu_loras=20, max_num_seqs=1)
    start_one_then_queue_another(eng, engine_adapters, ("first", "attn"), ("second", "attn"))
    queue_mlp_requests(eng, engine_adapters, PREFETCH_PER_STEP + 6)  # more than the three calls place
    for _ in range(100):  # every load collected: the queue holds every adapter
        eng.adapters.collect(0.05, eng.scheduler.add)
        if len(eng.adapters) == 0:
            break
    placed = lambda: eng.lora_manager.stats.loads  # noqa: E731
    before = placed()
    queue = eng.scheduler.in_turn
    eng.adapters.prefetch(queue(), busy=lambda: False)  # the GPU finished the step: one copy, then stop
    assert placed() == before + 1
    polls = []
    eng.adapters.prefetch(queue(), busy=lambda: polls.append(1) or len(polls) < 3)  # busy for two more copies
    assert placed() == before + 1 + 3
    eng.adapters.prefetch(queue())  # nothing to hide behind: up to the cap
    assert placed() == before + 4 + PREFETCH_PER_STEP
    assert not eng.runner.computing()  # the CPU ran its step before anything beside it
    step_to_end(eng, max_steps=300)


def queue_mlp_requests(eng, adapters, count: int) -> list[str]:
    """``count`` requests on the "mlp" adapter file under as many names (handles, slots)."""
    names = [f"mlp{i}" for i in range(count)]
    for i, name in enumerate(names):
        eng.add_request(name, {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest(name, 10 + i, str(adapters["mlp"])))
    return names


def test_an_adapter_the_prefetch_cannot_place_fails_only_its_requests(engine_adapters, monkeypatch):
    """The prefetch is where adapters get slots, so an adapter refused there (a `LoRAError` from
    the slot write) fails its own queued requests, with the error, and nothing else: the other
    requests finish with their adapters' outputs and the slot is left free."""
    from loramux.errors import LoRAError

    eng = engine(max_loras=4, max_cpu_loras=4, max_num_seqs=4)
    start_one_then_queue_another(eng, engine_adapters, ("first", "attn"), ("second", "mlp"))
    eng.add_request("refused", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("bad", 9, str(engine_adapters["all"])))
    eng.add_request("refused too", {"prompt_token_ids": PROMPT}, GREEDY, LoRARequest("bad", 9, str(engine_adapters["all"])))
    real_write = eng.lora_manager._write_slot

    def write(slot, adapter):
        if adapter.name == "bad":
            raise LoRAError("its weights could not be written.", adapter="bad")
        return real_write(slot, adapter)

    monkeypatch.setattr(eng.lora_manager, "_write_slot", write)
    outputs = {}
    for _ in range(300):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
    for name in ("refused", "refused too"):
        assert outputs[name].outputs[0].finish_reason == "error"
        assert "could not be written" in str(outputs[name].error) and outputs[name].outputs[0].token_ids == []
    assert outputs["first"].error is None and outputs["first"].outputs[0].token_ids == peft_greedy(
        engine_adapters["attn"], PROMPT, 40)
    assert outputs["second"].outputs[0].token_ids == peft_greedy(engine_adapters["mlp"], PROMPT, 6)
    assert "bad" not in eng.lora_manager.resident() and not eng.adapters
