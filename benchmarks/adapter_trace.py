"""A many-adapter serving trace and its driver (issue 10): who asks for which adapter, and when.

- :func:`make_trace`: N adapters of a mix of ranks and target sets, power-law (Zipf) popularity,
  Poisson arrivals, fixed-length random prompts; a fixed seed gives the same trace.
- :func:`write_adapter_files`: the adapters a trace uses, written as PEFT writes them
  (adapter_config.json + adapter_model.safetensors) with random weights, then dropped from the page
  cache, so that a cold load really reads the disk.
- :func:`run_trace`: a driver loop over the engine's public API (``add_request`` when a request's
  arrival time has passed, ``step`` otherwise), recording per request its arrival, first token,
  finish, adapter and whether that adapter was cold (in neither the CPU tier nor a GPU slot).
- :func:`summarize`: throughput, TTFT percentiles, cold against warm TTFT, failures;
  :func:`summarize_steps`: the steps' time by the tokens each forward ran.

Used by ``benchmarks/many_adapters.py`` and by its CPU smoke test.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from benchmarks._common import ALL_SEVEN, QKVO, QV, drop_from_page_cache, module_name, projection_shapes, write_peft_config

if TYPE_CHECKING:
    from loramux.engine.model_runner import StepShape

__all__ = [
    "DEFAULT_MIX", "AdapterKind", "RequestRecord", "Trace", "TraceAdapter", "TraceRequest", "adapter_nbytes",
    "is_resident", "make_trace", "run_trace", "summarize", "summarize_steps", "write_adapter_files",
]

TARGET_SETS = {"q/v": QV, "q/k/v/o": QKVO, "all 7": ALL_SEVEN}


@dataclass(frozen=True)
class AdapterKind:
    """One kind of adapter in the fleet: its rank, the projections it adapts, its share of adapters."""

    rank: int
    targets: str  # a key of TARGET_SETS
    share: float

    @property
    def label(self) -> str:
        return f"r{self.rank} {self.targets}"


# Most adapters of a fleet are small; the big ones (rank 64 on all seven projections: 335 MB at
# Llama-3.1-8B shapes in bf16) are a small share, so 1,000 of them average ~15 MB (~15 GB in all; a trace writes only those it uses).
DEFAULT_MIX = (
    AdapterKind(8, "q/v", 0.514), AdapterKind(16, "q/v", 0.22), AdapterKind(32, "q/v", 0.06),
    AdapterKind(64, "q/v", 0.01),
    AdapterKind(8, "q/k/v/o", 0.10), AdapterKind(16, "q/k/v/o", 0.04), AdapterKind(32, "q/k/v/o", 0.015),
    AdapterKind(64, "q/k/v/o", 0.005),
    AdapterKind(8, "all 7", 0.02), AdapterKind(16, "all 7", 0.01), AdapterKind(32, "all 7", 0.004),
    AdapterKind(64, "all 7", 0.002),
)


@dataclass(frozen=True)
class TraceAdapter:
    name: str
    lora_int_id: int
    rank: int
    targets: tuple[str, ...]
    seed: int  # of its random weights: every adapter has its own content (and digest)


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float  # since the trace starts
    adapter: TraceAdapter
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class Trace:
    adapters: list[TraceAdapter]  # all N, most popular first
    requests: list[TraceRequest]  # by arrival

    def used_adapters(self) -> list[TraceAdapter]:
        """The adapters some request asks for (the others are never read: no file is needed)."""
        return list({r.adapter.name: r.adapter for r in self.requests}.values())


def make_trace(
    num_adapters: int,
    num_requests: int,
    *,
    rate: float,
    prompt_len: int,
    vocab_size: int,
    seed: int = 0,
    mix: Sequence[AdapterKind] = DEFAULT_MIX,
    zipf_exponent: float = 1.0,
    name_prefix: str = "a",
    first_id: int = 1,
    request_seed: int | None = None,
) -> Trace:
    """N adapters (kinds drawn from ``mix`` by share), requests choosing adapter i with probability
    proportional to 1 / i^``zipf_exponent``, arriving as a Poisson process of ``rate`` requests/s
    (``math.inf``: all at once). Adapters are named ``{name_prefix}{i}`` with ids from ``first_id``.
    The adapters depend on ``seed`` only; the requests on ``request_seed`` too (default: ``seed``),
    so another ``request_seed`` gives other requests over the very same adapters.

    :raises ValueError: a count, length or rate that is not positive, an empty mix, a share that is
        not positive, a target set that is not one of ``TARGET_SETS``, or a negative exponent.
    """
    for what, value in (("num_adapters", num_adapters), ("num_requests", num_requests),
                        ("prompt_len", prompt_len), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_trace {what}: got {value!r}; allowed: an int >= 1")
    if vocab_size < 2:
        raise ValueError(f"make_trace vocab_size: got {vocab_size}; allowed: >= 2 (token 0 is left out of prompts)")
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"make_trace rate: got {rate!r}; allowed: requests per second > 0 (math.inf: all at once)")
    if not (isinstance(zipf_exponent, (int, float)) and zipf_exponent >= 0):
        raise ValueError(f"make_trace zipf_exponent: got {zipf_exponent!r}; allowed: a number >= 0 (0: uniform)")
    if not mix:
        raise ValueError("make_trace mix: got no adapter kinds; give at least one AdapterKind")
    for kind in mix:
        if kind.targets not in TARGET_SETS:
            raise ValueError(f"make_trace mix: target set {kind.targets!r} of {kind}; allowed: {sorted(TARGET_SETS)}")
        if not kind.share > 0 or isinstance(kind.rank, bool) or not isinstance(kind.rank, int) or kind.rank < 1:
            raise ValueError(f"make_trace mix: {kind} needs a share > 0 and an int rank >= 1")
    rng = random.Random(seed)
    kinds = rng.choices(list(mix), weights=[k.share for k in mix], k=num_adapters)
    adapters = [
        TraceAdapter(f"{name_prefix}{i}", first_id + i, kind.rank, TARGET_SETS[kind.targets], seed=rng.randrange(2**31))
        for i, kind in enumerate(kinds)
    ]
    if request_seed is not None:
        rng = random.Random(f"{seed}/{request_seed}")
    popularity = [1.0 / (i + 1) ** zipf_exponent for i in range(num_adapters)]
    chosen = rng.choices(adapters, weights=popularity, k=num_requests)
    arrival = 0.0
    requests = []
    for index, adapter in enumerate(chosen):
        if index and math.isfinite(rate):
            arrival += rng.expovariate(rate)
        prompt = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]
        tag = "" if request_seed is None else f"s{request_seed}-"
        requests.append(TraceRequest(f"{name_prefix}{tag}req{index}", arrival, adapter, prompt))
    return Trace(adapters, requests)


# -- adapter files ---------------------------------------------------------------------------------


def adapter_nbytes(config, rank: int, targets: Sequence[str], dtype: torch.dtype) -> int:
    """Bytes of the A and B weights of one adapter on ``targets`` of every layer of ``config``."""
    shapes = projection_shapes(config)
    per_layer = sum(rank * (shapes[p][0] + shapes[p][1]) for p in targets)
    return per_layer * config.get_text_config().num_hidden_layers * dtype.itemsize


_POOL_ELEMENTS = 1 << 23  # 8 Mi random values: every tensor is a slice of it at its own offset


def write_adapter_files(
    adapters: Sequence[TraceAdapter],
    config,
    directory: Path,
    dtype: torch.dtype,
    *,
    workers: int = 8,
    drop_cache: bool = True,
) -> dict[str, Path]:
    """Write each adapter as PEFT saves one, under ``directory/<name>``; returns name -> dir.

    Weights are slices of one random pool at offsets drawn from the adapter's seed (random
    generation would cost more than the disk), copied out so safetensors sees separate tensors.
    With ``drop_cache`` each file is synced and evicted from the page cache, so the first load
    reads the disk.
    """
    from safetensors.torch import save_file

    shapes = projection_shapes(config)
    layers = config.get_text_config().num_hidden_layers
    # std 0.02: the adapters' deltas stay small beside the base model's, as trained ones do
    pool = (torch.randn(_POOL_ELEMENTS, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)

    def write(adapter: TraceAdapter) -> tuple[str, Path]:
        rng = random.Random(adapter.seed)
        tensors = {}
        for layer in range(layers):
            for proj in adapter.targets:
                fan_in, fan_out = shapes[proj]
                for part, shape in (("lora_A", (adapter.rank, fan_in)), ("lora_B", (fan_out, adapter.rank))):
                    numel = shape[0] * shape[1]
                    if numel > _POOL_ELEMENTS:
                        raise ValueError(f"adapter {adapter.name!r}: a {shape} tensor is larger than the random "
                                         f"pool ({_POOL_ELEMENTS} values); raise _POOL_ELEMENTS")
                    start = rng.randrange(_POOL_ELEMENTS - numel + 1)
                    key = f"base_model.model.{module_name(layer, proj)}.{part}.weight"
                    tensors[key] = pool[start:start + numel].clone().view(shape)
        path = Path(directory) / adapter.name
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        write_peft_config(path, adapter.rank, adapter.targets)
        if drop_cache:
            drop_from_page_cache(path / "adapter_model.safetensors", path / "adapter_config.json")
        return adapter.name, path

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool_executor:
        return dict(pool_executor.map(write, adapters))


# -- driving the engine ---------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds since the trace started."""

    request_id: str
    adapter: str
    adapter_bytes: int
    cold: bool  # its adapter was in neither the CPU tier nor a GPU slot when the request arrived
    arrival_s: float  # when the trace says it arrives (TTFT counts from here)
    added_s: float  # when the driver handed it to the engine
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    error: str | None = None
    # when the engine said its adapter was loaded for it (the "ready" event; a request whose
    # adapter sat in a GPU slot gets none): a cold TTFT is the load, then the engine's wait
    adapter_ready_s: float | None = None
    # that load's own seconds, from its start (as the engine took its first request) to "ready", and
    # of those the registry's (resolve, read, check, validate: the handle's load_seconds, for the
    # load that issued the handle in this trace only; None for later loads of it); a request that
    # joined a load already running gets the same seconds, some of which came before it
    adapter_load_s: float | None = None
    adapter_registry_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


def is_resident(engine, name: str) -> bool:
    """Whether the adapter ``name`` sits in the CPU tier or a GPU slot (so no disk read is due).

    Read through the registry's public handle lookup and the tiers' membership; a GPU tier keyed
    by handle id or by name both answer.
    """
    handle = engine.registry.handle(name)
    if handle is not None and handle.id in engine.registry.cache:
        return True
    resident = set(engine.lora_manager.resident())
    return name in resident or (handle is not None and handle.id in resident)


def run_trace(
    engine,
    trace: Trace,
    paths: dict[str, Path],
    *,
    max_tokens: int,
    adapter_bytes: Callable[[TraceAdapter], int] = lambda adapter: 0,
    progress: Callable[[int, int, float], None] | None = None,
    progress_every_s: float = 5.0,
    steps: list[tuple[StepShape, float]] | None = None,
    phases: list[dict[str, float]] | None = None,
    load_calls: dict[str, list[float]] | None = None,
    feed: str = "steps",
) -> list[RequestRecord]:
    """Replay ``trace`` in real time through ``engine`` (an ``LLMEngine``); the record of each request.

    Every request generates exactly ``max_tokens`` tokens (greedy, ``ignore_eos``), with its
    adapter registered by path (``LoRARequest(name, id, path)``), so a cold adapter is read from
    disk. ``progress(finished, total, seconds)`` is called every ``progress_every_s``. Each step
    that computed tokens appends ``(engine.runner.last_step, its seconds)`` to ``steps`` if given,
    and, with ``phases`` given too, the seconds it spent in each of `STEP_PHASES` to ``phases``.
    With ``load_calls``, the seconds of each call of the cold path's `LOAD_PARTS` go to
    ``load_calls[name]``.

    ``feed``: ``"steps"`` adds the requests that have arrived between steps, on the stepping
    thread; ``"thread"`` adds each as it arrives from a thread of its own, as the server's intake
    thread does beside its step loop (`loramux.serving.async_engine`): a cold adapter's load then
    starts at its arrival, not at the end of the step it arrived in.
    """
    if feed not in FEEDS:
        raise ValueError(f"feed={feed!r}: give one of {', '.join(FEEDS)}")
    from loramux import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending = deque(trace.requests)
    records: dict[str, RequestRecord] = {}
    finished = 0
    start = time.perf_counter()
    last_report = start

    issued: set[int] = set()  # handles whose registry seconds a "ready" event reported already

    def on_event(event) -> None:  # in the loading thread; the record was made before add_request
        if event.kind == "ready":
            ready_s = time.perf_counter() - start  # one time for all of this load's waiters
            # a handle's load_seconds timed the load that issued it; a later load of the same
            # content (read again after the CPU tier let it go, or found there) keeps that handle
            handle = event.handle
            registry_s = None
            if handle is not None and handle.id not in issued:
                issued.add(handle.id)
                registry_s = handle.load_seconds
            for request_id in event.request_ids:
                if request_id in records:
                    record = records[request_id]
                    record.adapter_ready_s = ready_s
                    record.adapter_load_s = event.seconds
                    record.adapter_registry_s = registry_s

    engine.add_event_listener(on_event)
    add = functools.partial(_add_arrived, engine, pending, records, params, paths, adapter_bytes, start)
    with _phases_timed(engine, phases is not None) as spent, _load_parts_timed(engine, load_calls), \
            contextlib.ExitStack() as stack:
        stack.callback(engine.remove_event_listener, on_event)
        feeder = _Feeder(add, pending, start) if feed == "thread" else None
        if feeder is not None:
            stack.callback(feeder.join)  # and re-raise what it raised
        while (feeder.is_alive() if feeder is not None else pending) or engine.has_unfinished_requests():
            if feeder is None:
                add()
            step = _replay_step(engine, None if feeder is not None else pending, start)
            if step is None:
                continue
            shape, seconds, now, outputs = step
            if steps is not None and shape is not None:
                steps.append((shape, seconds))
                if phases is not None:
                    phases.append(dict(spent))
            spent.clear()
            for out in outputs:
                record = records[out.request_id]
                tokens = len(out.outputs[0].token_ids)
                if tokens and record.first_token_s is None:
                    record.first_token_s = now
                if out.finished:
                    record.finish_s, record.output_tokens = now, tokens
                    if out.error is not None or out.outputs[0].finish_reason in ("error", "abort"):
                        record.error = str(out.error or out.outputs[0].finish_reason)
                    finished += 1
            if progress is not None and time.perf_counter() - last_report >= progress_every_s:
                last_report = time.perf_counter()
                progress(finished, len(trace.requests), last_report - start)
    return [records[r.request_id] for r in trace.requests]


def _add_arrived(engine, pending, records, params, paths, adapter_bytes, start) -> None:
    """Add the requests whose arrival time has passed, each with its record made first."""
    from loramux import LoRARequest

    now = time.perf_counter() - start
    while pending and pending[0].arrival_s <= now:
        request = pending.popleft()
        adapter = request.adapter
        records[request.request_id] = RequestRecord(
            request.request_id, adapter.name, adapter_bytes(adapter), cold=not is_resident(engine, adapter.name),
            arrival_s=request.arrival_s, added_s=now)
        lora = LoRARequest(adapter.name, adapter.lora_int_id, str(paths[adapter.name]))
        engine.add_request(request.request_id, {"prompt_token_ids": request.prompt_token_ids}, params, lora)


class _Feeder(threading.Thread):
    """Adds each request of ``pending`` at its arrival time (``add``), beside the stepping thread;
    `join` re-raises what it raised."""

    def __init__(self, add: Callable[[], None], pending, start: float) -> None:
        super().__init__(name="trace-feed", daemon=True)
        self._add, self._pending, self._start = add, pending, start
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            while self._pending:
                time.sleep(max(0.0, self._pending[0].arrival_s - (time.perf_counter() - self._start)))
                self._add()
        except BaseException as error:  # the stepping thread re-raises it
            self.error = error

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _replay_step(engine, pending, start):
    """One step: (its shape, seconds, the time after it, its outputs), or None while the engine
    idles until the next arrival (``pending``: the requests not added yet, or None when a feeder
    thread adds them)."""
    if not engine.has_unfinished_requests():
        now = time.perf_counter() - start
        if pending:  # idle until the next arrival
            time.sleep(max(0.0, min(pending[0].arrival_s - now, 0.01)))
        elif pending is None:
            time.sleep(0.0005)  # the feeder adds the next
        return None
    engine.runner.last_step = None
    began = time.perf_counter()
    outputs = engine.step()
    ended = time.perf_counter()
    return engine.runner.last_step, ended - began, ended - start, outputs


#: How `run_trace` hands requests to the engine.
FEEDS = ("steps", "thread")


# the parts of `LLMEngine.step` timed apart: (name, the engine's attribute that owns it, or None for
# the engine, method). "forward" launches a step's GPU work; "receive" waits for a step's tokens (on
# CUDA with async scheduling, the step before the one just launched) and appends them
STEP_PHASES = (("collect", "adapters", "collect"), ("prefetch", "adapters", "prefetch"),
               ("schedule", "scheduler", "schedule"), ("forward", "runner", "run"), ("receive", None, "_receive"))
# the GPU tier's work inside those phases (prefetch, or admission in schedule), timed apart too, as
# "lora.<part>": placement checks, evictions that make room, slot writes (the copy's host work).
# What prefetch spent beyond its parts waited for the manager's lock or the GIL.
LORA_PARTS = (("lora.can_place", "lora_manager", "can_place"), ("lora.make_room", "lora_manager", "_make_room"),
              ("lora.slot_write", "lora_manager", "_write_slot"))


# the cold path's parts, timed per call on the loading threads: (name, the module or the engine's
# attribute that owns it, function): the file's read and hash, the checks that make the adapter of
# it, the engine's validation, the CPU tier's insert
LOAD_PARTS = (("load.read", "loramux.registry.loader", "_read_tensors"),
              ("load.checks", "loramux.registry.loader", "_checked_adapter"),
              ("load.validate", "registry", "_validate"), ("load.cpu_tier", "registry.cache", "put"))


@contextlib.contextmanager
def _load_parts_timed(engine, calls: dict[str, list[float]] | None):
    """While ``calls`` is given, wrap `LOAD_PARTS` so each call appends its seconds to
    ``calls[name]`` (from any thread: one append is atomic under the GIL); put them back on exit."""
    targets = []
    for name, owner_path, attr in LOAD_PARTS if calls is not None else ():
        owner = importlib.import_module(owner_path) if owner_path.startswith("loramux.") else engine
        if owner is engine:
            for part in owner_path.split("."):
                owner = getattr(owner, part, None)
        targets.append((name, owner, attr))
        calls.setdefault(name, [])
    with _calls_timed(targets, lambda name, seconds: calls[name].append(seconds)):
        yield


@contextlib.contextmanager
def _phases_timed(engine, on: bool):
    """While on, wrap the methods `STEP_PHASES` and `LORA_PARTS` name on ``engine``'s parts so
    each adds its seconds to the yielded dict (the caller clears it per step); put them back on
    exit."""
    spent: dict[str, float] = {}
    targets = [(name, engine if owner_attr is None else getattr(engine, owner_attr, None), method)
               for name, owner_attr, method in (STEP_PHASES + LORA_PARTS if on else ())]
    with _calls_timed(targets, lambda name, seconds: spent.__setitem__(name, spent.get(name, 0.0) + seconds)):
        yield spent


@contextlib.contextmanager
def _calls_timed(targets, record: Callable[[str, float], None]):
    """Wrap each ``(name, owner, attribute)`` of ``targets`` (an owner or attribute that is None is
    skipped) so that every call tells ``record(name, its seconds)``; put them back on exit."""
    restore = []
    for name, owner, attr in targets:
        real = getattr(owner, attr, None) if owner is not None else None
        if real is None:
            continue

        def timed(*args, _real=real, _name=name, **kwargs):
            began = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                record(_name, time.perf_counter() - began)

        restore.append((owner, attr, vars(owner).get(attr, _ABSENT)))
        setattr(owner, attr, timed)
    try:
        yield
    finally:
        for owner, attr, before in reversed(restore):
            if before is _ABSENT:
                delattr(owner, attr)  # the instance attribute goes: the class's method shows again
            else:
                setattr(owner, attr, before)


_ABSENT = object()


def summarize_steps(steps: Sequence[tuple[StepShape, float]], phases: Sequence[dict[str, float]] | None = None,
                    slowest: int = 10) -> dict:
    """Where a trace's step time went, by the tokens each forward ran (a graph's padded size):
    steps, mean milliseconds, mean tokens and prompt tokens; over all steps, the share that
    computed prompt tokens and the share of the forwards' tokens that were padding. With the
    steps' ``phases`` (`run_trace`): the mean milliseconds of each phase per size, each phase's
    total over the trace, and the ``slowest`` steps with theirs."""
    by_size: dict[int, list[int]] = {}
    for i, (shape, _) in enumerate(steps):
        by_size.setdefault(shape.padded_tokens, []).append(i)
    computed = sum(shape.num_tokens for shape, _ in steps)
    ran = sum(shape.padded_tokens for shape, _ in steps)

    def phase_ms(indices) -> dict[str, float]:
        names = {name for i in indices for name in phases[i]}
        return {name: 1e3 * sum(phases[i].get(name, 0.0) for i in indices) / len(indices) for name in sorted(names)}

    summary = {
        "steps": len(steps),
        "step_ms_mean": 1e3 * sum(s for _, s in steps) / len(steps) if steps else None,
        "with_prompt_share": sum(shape.prompt_tokens > 0 for shape, _ in steps) / len(steps) if steps else None,
        "padding_share": 1 - computed / ran if ran else None,
        "by_padded_tokens": {
            T: {"steps": len(group), "ms_mean": 1e3 * sum(steps[i][1] for i in group) / len(group),
                "tokens_mean": sum(steps[i][0].num_tokens for i in group) / len(group),
                "prompt_tokens_mean": sum(steps[i][0].prompt_tokens for i in group) / len(group),
                "graph_share": sum(steps[i][0].graph for i in group) / len(group),
                **({"phase_ms_mean": phase_ms(group)} if phases else {})}
            for T, group in sorted(by_size.items())
        },
    }
    if phases:
        summary["phase_ms_total"] = {name: 1e3 * sum(p.get(name, 0.0) for p in phases)
                                     for name in sorted({name for p in phases for name in p})}
        order = sorted(range(len(steps)), key=lambda i: -steps[i][1])[:slowest]
        summary["slowest"] = [{"index": i, "ms": 1e3 * steps[i][1], "tokens": steps[i][0].num_tokens,
                               "prompt_tokens": steps[i][0].prompt_tokens, "padded_tokens": steps[i][0].padded_tokens,
                               "phase_ms": phase_ms([i])} for i in order]
    return summary


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Throughput (output tokens over first arrival to last finish), TTFT p50/p99, cold and warm
    TTFT p50 (ms), and the requests that failed or never finished. A cold TTFT is split in two:
    arrival to the adapter's "ready" event (resolve, read, validate) and from there to the first
    token (the engine's wait: collection, GPU slot, admission, the prefill step), p50 of each."""
    done = [r for r in records if r.finish_s is not None and r.error is None]
    failed = [r for r in records if r.error is not None or r.finish_s is None]
    ttft = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    cold = [r for r in done if r.cold and r.ttft_s is not None]
    warm = [r for r in done if not r.cold and r.ttft_s is not None]
    tokens = sum(r.output_tokens for r in done)
    span = (max(r.finish_s for r in done) - min(r.arrival_s for r in records)) if done else None
    return {
        "requests": len(records),
        "failed": len(failed),
        "failures": sorted({r.error or "did not finish" for r in failed})[:5],
        "output_tokens": tokens,
        "seconds": span,
        "tokens_per_s": tokens / span if span else None,
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "e2e_p50_ms": _percentile([(r.finish_s - r.arrival_s) * 1e3 for r in done], 50),
        "cold_requests": len(cold),
        "cold_ttft_p50_ms": _percentile([r.ttft_s * 1e3 for r in cold], 50),
        "warm_ttft_p50_ms": _percentile([r.ttft_s * 1e3 for r in warm], 50),
        "cold_adapter_bytes_p50": _percentile([r.adapter_bytes for r in cold], 50),
        "cold_ready_p50_ms": _percentile([(r.adapter_ready_s - r.arrival_s) * 1e3 for r in cold
                                          if r.adapter_ready_s is not None], 50),
        "cold_ready_to_first_token_p50_ms": _percentile([(r.first_token_s - r.adapter_ready_s) * 1e3 for r in cold
                                                         if r.adapter_ready_s is not None], 50),
        # the first part split again: arrival to the engine taking the request (the driver adds
        # between steps), the load's own run, and the registry's share of it
        "cold_handed_over_p50_ms": _percentile([(r.added_s - r.arrival_s) * 1e3 for r in cold], 50),
        "cold_load_run_p50_ms": _percentile([r.adapter_load_s * 1e3 for r in cold if r.adapter_load_s is not None], 50),
        "cold_registry_p50_ms": _percentile([r.adapter_registry_s * 1e3 for r in cold
                                             if r.adapter_registry_s is not None], 50),
        "adapters_used": len({r.adapter for r in records}),
    }
