"""Resolve and load adapters beside the step loop, in worker threads; a failure fails only its requests.

The step loop hands over each request whose adapter it has no handle for yet and, at the top of
every step, collects the loads that finished. Requests naming the same adapter share one load
(the registry below is single-flight as well, for loads started elsewhere). Any exception becomes
a `LoRAError` naming the adapter, handed to exactly the requests that asked for it.

An adapter already in the CPU tier needs no worker: ``resident`` finds it in the submitting
thread, and its load settles there at once (a burst of requests over a hundred resident
adapters would otherwise start a hundred threads, each waiting for the GIL).

A load is keyed by the request's own words (name, id, path): before it finishes there is no
handle to key it by. The moment it settles, in whichever thread, ``on_settled`` hears of it,
so the engine can say "adapter ready" or "adapter failed" without waiting for a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from loramux.engine.sequence import Sequence
from loramux.errors import LoRAError
from loramux.registry import LoRAAdapter, LoRARequest

__all__ = ["AdapterLoader", "LoadResult"]


@dataclass
class LoadResult:
    """A finished load: the requests that waited for it, and the adapter or the error.

    ``seconds`` is resolve + load (+ validate) as this load saw it. A successful load holds one
    CPU-tier pin on the adapter (``registry.get(pin=True)``); whoever collects it releases it.
    """

    waiters: list[Sequence]
    adapter: LoRAAdapter | None
    error: LoRAError | None
    seconds: float


@dataclass
class _Load:
    request: LoRARequest
    future: Future = field(default_factory=Future)
    waiters: list[Sequence] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0
    settled: bool = False  # on_settled was told (for the waiters then)
    outcome: tuple = (None, None)  # (adapter, error) once settled


SettledCallback = Callable[[list[Sequence], LoRAAdapter | None, BaseException | None, float], None]


class AdapterLoader:
    """Loads for waiting requests. ``submit``, ``discard`` and ``poll`` come from the step loop's
    thread; workers only finish their load and call ``on_settled``.

    :param load: ``load(lora_request) -> LoRAAdapter``: resolve, load and validate (runs in a
        worker thread; may block on I/O). It pins what it returns in the CPU tier.
    :param resident: ``resident(lora_request) -> LoRAAdapter | None``: the adapter if it is in
        memory already, pinned and checked as ``load`` would; never blocks on I/O (runs in the
        submitting thread). None: ``load`` runs in a worker.
    :param max_workers: loads of different adapters that may run at once.
    :param on_settled: ``on_settled(waiters, adapter, error, seconds)``, called in the thread
        that settles a load as it ends (its worker, or the submitting thread for an adapter in
        memory; and in the step loop for a request that joins a load already ended); must be
        quick and thread-safe.
    """

    def __init__(self, load: Callable[[LoRARequest], LoRAAdapter], *, max_workers: int = 4,
                 on_settled: SettledCallback | None = None,
                 resident: Callable[[LoRARequest], LoRAAdapter | None] | None = None) -> None:
        self._load = load
        self._resident = resident
        self._on_settled = on_settled
        # Daemon threads, not a ThreadPoolExecutor: its workers are joined at interpreter exit,
        # so one resolver hanging forever would keep a stopped server from exiting.
        self._workers = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()  # the waiter lists: the step loop adds, a worker reads
        self._loads: dict[tuple, _Load] = {}

    def __len__(self) -> int:
        """Requests waiting for a load."""
        with self._lock:
            return sum(len(load.waiters) for load in self._loads.values())

    def in_flight(self) -> int:
        """Loads not collected yet (running, or done and not polled): each may hold a CPU-tier pin."""
        with self._lock:
            return len(self._loads)

    def submit(self, seq: Sequence) -> None:
        """Start (or join) the load of ``seq``'s adapter."""
        request = seq.lora_request
        assert request is not None, "a request without an adapter needs no load"
        key = (request.lora_name, request.lora_int_id, request.lora_path)
        with self._lock:
            load = self._loads.get(key)
            start = load is None
            if start:
                load = self._loads[key] = _Load(request)
            load.waiters.append(seq)
            late = load.settled
        if start and not self._settled_resident(load):
            threading.Thread(target=self._run, args=(load,), name=f"loramux-load-{request.lora_name}",
                             daemon=True).start()
        elif late and self._on_settled is not None:
            self._on_settled([seq], *load.outcome, load.seconds)

    def discard(self, seq: Sequence) -> bool:
        """Forget ``seq`` (aborted); its adapter's load carries on for the others."""
        request = seq.lora_request
        with self._lock:
            load = self._loads.get((request.lora_name, request.lora_int_id, request.lora_path))
            if load is not None and seq in load.waiters:
                load.waiters.remove(seq)
                return True
        return False

    def poll(self, timeout: float = 0.0) -> list[LoadResult]:
        """The loads that finished, each with its waiters; waits up to ``timeout`` for one."""
        with self._lock:
            futures = [load.future for load in self._loads.values()]
        if timeout > 0 and futures and not any(f.done() for f in futures):
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        with self._lock:
            done = [key for key, load in self._loads.items() if load.future.done()]
            loads = [self._loads.pop(key) for key in done]
        return [LoadResult(load.waiters, *self._outcome(load), load.seconds) for load in loads]

    @staticmethod
    def _outcome(load: _Load) -> tuple[LoRAAdapter | None, LoRAError | None]:
        if load.future.cancelled():
            return None, LoRAError("its load was cancelled.", adapter=load.request.lora_name)
        error = load.future.exception()
        return (None, error) if error is not None else (load.future.result(), None)

    def _settled_resident(self, load: _Load) -> bool:
        """Settle ``load`` now, in this thread, if its adapter is in memory already."""
        if self._resident is None:
            return False
        try:
            adapter = _guarded(self._resident, load.request)
        except BaseException as error:  # its checks failed: the waiters hear of it as from a worker
            self._settle(load, (None, error))
            return True
        if adapter is None:
            return False
        self._settle(load, (adapter, None))
        return True

    def _run(self, load: _Load) -> None:
        with self._workers:  # at most max_workers loads at once; the rest queue here
            if not load.future.set_running_or_notify_cancel():  # shut down meanwhile
                return
            try:
                outcome = (_guarded(self._load, load.request), None)
            except BaseException as error:  # every waiter must hear of it, whatever it is
                outcome = (None, error)
            self._settle(load, outcome)

    def _settle(self, load: _Load, outcome: tuple) -> None:
        """Tell the waiters (``on_settled``), then let `poll` see the load."""
        load.seconds = time.perf_counter() - load.started
        with self._lock:  # a waiter joins either before (told here) or after (told by submit)
            load.outcome, load.settled = outcome, True
            waiters = list(load.waiters)
        if self._on_settled is not None and waiters:  # before poll can see it: events lead outputs
            self._on_settled(waiters, *outcome, load.seconds)
        adapter, error = outcome
        if error is None:
            load.future.set_result(adapter)
        else:
            load.future.set_exception(error)

    def shutdown(self) -> None:
        """Forget pending loads; their threads finish (or hang) on their own, as daemons, and
        report to no one (the callbacks are dropped: they belong to a closed engine)."""
        with self._lock:
            for load in self._loads.values():
                load.future.cancel()
            self._loads.clear()
            self._load = self._resident = self._on_settled = None


def _guarded(load: Callable[[LoRARequest], LoRAAdapter], request: LoRARequest) -> LoRAAdapter:
    try:
        return load(request)
    except LoRAError:
        raise
    except Exception as error:  # a resolver or plugin bug: still only this adapter's requests fail
        raise LoRAError(
            f"loading it failed: {type(error).__name__}: {error}",
            adapter=request.lora_name,
            path=request.lora_path or None,
            fix="Check the adapter's source and the resolver plugins (`loramux plugins`).",
        ) from error
