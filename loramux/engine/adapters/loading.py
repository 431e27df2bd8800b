"""The requests waiting for their adapter's load, beside the step loop; a failure fails only them.

The step loop hands over each request whose adapter it has no handle for yet (`AdapterLoader.submit`)
and, at the top of every step, collects the loads that ended (`AdapterLoader.poll`). Requests
naming the same adapter the same way (name, id, path) wait behind one `Registry.load`: the
registry runs it on its loading threads and merges it with any other load of that name. An
adapter in the CPU tier already settles at once, in the submitting thread. Any exception becomes
a `LoRAError` naming the adapter, handed to exactly the requests that asked for it.

The moment a load settles, in whichever thread, ``on_settled`` hears of it, so the engine can say
"adapter ready" or "adapter failed" without waiting for a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from loramux.engine.core.sequence import Sequence
from loramux.errors import LoRAError
from loramux.registry import LoRAAdapter, LoRARequest, Registry

__all__ = ["AdapterLoader", "LoadResult"]


@dataclass
class LoadResult:
    """A load that ended: the requests that waited for it, and the adapter or the error.

    ``seconds`` is resolve + load (+ checks) as these requests saw it. A successful load holds one
    CPU-tier pin on the adapter; whoever collects it releases it.
    """

    waiters: list[Sequence]
    adapter: LoRAAdapter | None
    error: LoRAError | None
    seconds: float


@dataclass(eq=False)
class _Wait:
    """The requests that name one adapter the same way, behind one registry load."""

    request: LoRARequest
    waiters: list[Sequence] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0
    settled: bool = False  # on_settled was told (for the waiters then)
    outcome: tuple = (None, None)  # (adapter, error) once settled


SettledCallback = Callable[[list[Sequence], LoRAAdapter | None, BaseException | None, float], None]


class AdapterLoader:
    """Requests waiting for their adapter. ``submit``, ``discard`` and ``poll`` come from the step
    loop's thread (``submit`` also from ``add_request``'s caller); the loading threads settle.

    :param registry: loads the adapters (`Registry.load`, pinned once for each wait).
    :param check: ``check(adapter)``, run as a load settles: raises if the adapter may not be
        served here (the error fails the waiters; the load's pin is released first).
    :param on_settled: ``on_settled(waiters, adapter, error, seconds)``, called in the thread that
        settles a load as it ends (a loading thread, or the submitting one for an adapter in
        memory; and the step loop's for a request that joins a load already ended); must be quick
        and thread-safe.
    """

    def __init__(self, registry: Registry, *, check: Callable[[LoRAAdapter], None],
                 on_settled: SettledCallback) -> None:
        self._registry = registry
        self._check = check
        self._on_settled = on_settled
        self._lock = threading.Condition()  # the waits: the step loop adds, a loading thread settles
        self._waits: dict[tuple, _Wait] = {}
        self._closed = False

    def __len__(self) -> int:
        """Requests waiting for a load."""
        with self._lock:
            return sum(len(wait.waiters) for wait in self._waits.values())

    def in_flight(self) -> int:
        """Loads not collected yet (running, or ended and not polled): each may hold a CPU-tier pin."""
        with self._lock:
            return len(self._waits)

    def submit(self, seq: Sequence) -> None:
        """Start (or join) the load of ``seq``'s adapter."""
        request = seq.lora_request
        assert request is not None, "a request without an adapter needs no load"
        with self._lock:
            wait = self._waits.get(_key(request))
            start = wait is None
            if start:
                wait = self._waits[_key(request)] = _Wait(request)
            wait.waiters.append(seq)
            late = wait.settled
        if start:
            self._registry.load(request, pin=True).add_done_callback(lambda done: self._settle(wait, done))
        elif late:
            self._on_settled([seq], *wait.outcome, wait.seconds)

    def discard(self, seq: Sequence) -> bool:
        """Forget ``seq`` (aborted); its adapter's load carries on for the others."""
        with self._lock:
            wait = self._waits.get(_key(seq.lora_request))
            if wait is not None and seq in wait.waiters:
                wait.waiters.remove(seq)
                return True
        return False

    def poll(self, timeout: float = 0.0) -> list[LoadResult]:
        """The loads that ended, each with its waiters; waits up to ``timeout`` for one."""
        with self._lock:
            if timeout > 0 and self._waits and not any(wait.settled for wait in self._waits.values()):
                self._lock.wait(timeout)
            done = [key for key, wait in self._waits.items() if wait.settled]
            ended = [self._waits.pop(key) for key in done]
        return [LoadResult(wait.waiters, *wait.outcome, wait.seconds) for wait in ended]

    def _settle(self, wait: _Wait, done: Future) -> None:
        """A load ended (in its thread): check it, tell the waiters (``on_settled``), then let
        `poll` see it."""
        adapter, error = _outcome(done, wait.request)
        check = self._check
        if adapter is not None and check is not None:
            try:
                check(adapter)
            except BaseException as failure:  # the check released the load's pin
                adapter, error = None, _as_lora_error(failure, wait.request)
        wait.seconds = time.perf_counter() - wait.started
        with self._lock:  # a waiter joins either before (told here) or after (told by submit)
            if self._closed:  # its engine is gone: so is the pin's owner
                if adapter is not None:
                    self._registry.cache.unpin(adapter.handle.id)
                return
            wait.outcome = (adapter, error)
            waiters, on_settled = list(wait.waiters), self._on_settled
        if waiters:  # before poll can see it: events lead outputs
            on_settled(waiters, adapter, error, wait.seconds)
        with self._lock:
            wait.settled = True
            self._lock.notify_all()

    def shutdown(self) -> None:
        """Forget pending loads; they finish on the loading threads and report to no one (the
        callbacks belong to a closed engine), their pins released."""
        with self._lock:
            self._closed = True
            ended = [wait for wait in self._waits.values() if wait.outcome[0] is not None]
            self._waits.clear()
            self._check = self._on_settled = None
        for wait in ended:
            self._registry.cache.unpin(wait.outcome[0].handle.id)


def _key(request: LoRARequest) -> tuple:
    return request.lora_name, request.lora_int_id, request.lora_path


def _outcome(done: Future, request: LoRARequest) -> tuple[LoRAAdapter | None, LoRAError | None]:
    error = done.exception()
    if error is None:
        return done.result(), None
    return None, _as_lora_error(error, request)


def _as_lora_error(error: BaseException, request: LoRARequest) -> LoRAError:
    if isinstance(error, LoRAError):
        return error
    return LoRAError(  # a resolver or plugin bug: still only this adapter's requests fail
        f"loading it failed: {type(error).__name__}: {error}",
        adapter=request.lora_name,
        path=request.lora_path or None,
        fix="Check the adapter's source and the resolver plugins (`loramux plugins`).",
    )
