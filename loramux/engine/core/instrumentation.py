"""Named timing points of the engine's step, for benchmarks and profilers.

    def on_step(timings: StepTimings) -> None:
        print(timings.seconds, timings.phase("schedule"), timings.launched)

    engine.add_step_listener(on_step)

After every `LLMEngine.step` that has a listener, each listener gets a `StepTimings`: the step's
wall time, the seconds spent at each of `POINTS` in it, the shape of the forward it launched, and
the forwards whose tokens it read back (`BatchTimings`: launched and received on the host clock;
with async scheduling a forward's tokens are read in the step after the one that launched it).

The points (`POINTS`) are part of the API: a benchmark reads a point by name with
`StepTimings.phase`, and a name that is not a point raises `ValueError`, so a renamed point fails
loudly instead of reading zero.

- ``collect``: finished adapter loads collected (waits briefly when the engine is idle).
- ``prefetch``: queued requests' adapters copied into GPU slots.
- ``schedule``: the scheduler's decision (admission, preemption, chunking).
- ``forward``: the step's GPU work launched (inputs, graph replay or eager forward, sampling).
- ``receive``: tokens read back (waits for the GPU), appended, stops checked.
- ``lora.can_place``: the GPU tier asked whether an adapter fits (inside ``schedule``).
- ``lora.place``: adapters placed in GPU slots: evictions and slot writes (inside ``prefetch``
  and ``schedule``).

Without a listener the points cost a flag test each: no clock read, no allocation. Listeners run
on the stepping thread after the step's work; one that raises propagates out of ``step`` (they
are measurement code: a broken one must not go unnoticed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

__all__ = ["BatchTimings", "POINTS", "StepClock", "StepListener", "StepTimings"]

#: Every timing point, in the order a step reaches them.
POINTS = ("collect", "prefetch", "schedule", "forward", "receive", "lora.can_place", "lora.place")


def check_point(name: str) -> str:
    """``name`` if it is one of `POINTS`.

    :raises ValueError: it is not, naming the points there are.
    """
    if name not in POINTS:
        raise ValueError(f"{name!r} is not a timing point of the engine; the points are {', '.join(POINTS)}")
    return name


@dataclass(frozen=True)
class BatchTimings:
    """One forward, from its launch to its tokens on the host (``time.perf_counter`` seconds).

    :ivar num_seqs: sequences in the batch.
    :ivar num_tokens: tokens computed (decodes and prefill chunks).
    :ivar prompt_tokens: of those, prompt tokens.
    :ivar padded_tokens: tokens the forward ran (a CUDA graph's size, or ``num_tokens``).
    :ivar graph: whether it replayed a CUDA graph.
    :ivar kv_tokens: tokens whose K/V the forward attends to, summed over its sequences.
    :ivar launched_at: when its launch began.
    :ivar received_at: when its tokens were on the host.
    """

    num_seqs: int
    num_tokens: int
    prompt_tokens: int
    padded_tokens: int
    graph: bool
    kv_tokens: int
    launched_at: float
    received_at: float = 0.0


@dataclass(frozen=True)
class StepTimings:
    """What one call of ``LLMEngine.step`` spent, and on what.

    :ivar started: ``time.perf_counter()`` as the step began.
    :ivar seconds: the step's wall time.
    :ivar phases: seconds spent at each point the step reached (see `phase`).
    :ivar launched: the forward this step launched (its ``received_at`` is 0 until read), or None.
    :ivar received: the forwards whose tokens this step read back, in launch order.
    """

    started: float
    seconds: float
    phases: Mapping[str, float] = field(default_factory=dict)
    launched: BatchTimings | None = None
    received: tuple[BatchTimings, ...] = ()

    def phase(self, name: str) -> float:
        """Seconds spent at point ``name`` in this step (0.0 where the step did not reach it).

        :raises ValueError: ``name`` is not one of `POINTS`.
        """
        return self.phases.get(check_point(name), 0.0)


StepListener = Callable[[StepTimings], None]


class _Point:
    """A reusable context manager adding its block's seconds to one point of a `StepClock`."""

    __slots__ = ("_clock", "_name", "_timing", "began")

    def __init__(self, clock: StepClock, name: str) -> None:
        self._clock, self._name, self._timing, self.began = clock, name, False, 0.0

    def __enter__(self) -> None:
        if self._clock.on:
            self._timing, self.began = True, time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self._timing:
            self._timing = False
            spent = self._clock._spent
            spent[self._name] = spent.get(self._name, 0.0) + time.perf_counter() - self.began


class StepClock:
    """The engine's side of the points: ``with clock["schedule"]: ...`` around each part of a
    step, `launched` after each forward's launch and `received` after each read, and ``with clock.step:`` around the whole
    step, which hands the listeners its `StepTimings`. Used from the stepping thread only."""

    def __init__(self) -> None:
        self.on = False  # a listener is attached
        self._listeners: list[StepListener] = []
        self._points = {name: _Point(self, name) for name in POINTS}
        self._spent: dict[str, float] = {}
        self._started = 0.0
        self._launched: BatchTimings | None = None
        # forwards are read back in launch order: counting both matches each read to its launch,
        # also for a forward launched before the listener came (it has no timings)
        self._launches = self._receives = 0
        self._in_flight: deque[tuple[int, BatchTimings]] = deque()
        self._received: list[BatchTimings] = []
        self.step = _Step(self)

    def __getitem__(self, name: str) -> _Point:
        point = self._points.get(name)
        return point if point is not None else self._points[check_point(name)]

    def add_listener(self, listener: StepListener) -> None:
        self._listeners.append(listener)
        self.on = True

    def remove_listener(self, listener: StepListener) -> None:
        self._listeners.remove(listener)
        self.on = bool(self._listeners)
        if not self.on:
            self._in_flight.clear()

    def launched(self, shape, batch) -> None:
        """The forward of ``batch`` (a ``SchedulerOutput``, before its sequences count the tokens
        as computed) was launched in the ``forward`` block just left; ``shape`` is the runner's
        ``StepShape`` of it."""
        self._launches += 1
        if self.on:
            kv_tokens = sum(seq.num_computed + n for seq, n in batch.chunks)
            self._launched = BatchTimings(shape.num_seqs, shape.num_tokens, shape.prompt_tokens, shape.padded_tokens,
                                          shape.graph, kv_tokens, self._points["forward"].began)
            self._in_flight.append((self._launches, self._launched))

    def received(self) -> None:
        """The oldest forward not read yet has its tokens on the host."""
        self._receives += 1
        if self._in_flight and self._in_flight[0][0] == self._receives:
            batch = self._in_flight.popleft()[1]
            self._received.append(replace(batch, received_at=time.perf_counter()))

    def _begin(self) -> None:
        if self.on:
            self._started = time.perf_counter()
            self._spent, self._launched, self._received = {}, None, []

    def _end(self) -> None:
        if not self.on or not self._started:
            return
        timings = StepTimings(self._started, time.perf_counter() - self._started, self._spent,
                              self._launched, tuple(self._received))
        self._started = 0.0
        for listener in list(self._listeners):
            listener(timings)


class _Step:
    """``with clock.step:``: the whole of one ``LLMEngine.step`` (listeners are told on a clean exit)."""

    __slots__ = ("_clock",)

    def __init__(self, clock: StepClock) -> None:
        self._clock = clock

    def __enter__(self) -> None:
        self._clock._begin()

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self._clock._end()
        else:
            self._clock._started = 0.0
