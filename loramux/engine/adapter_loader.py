"""Resolve and load adapters beside the step loop, in a thread pool; a failure fails only its requests.

The step loop hands over each request whose adapter it has not seen ready and, at the top of
every step, collects the loads that finished. Requests for the same adapter share one load
(the registry below is single-flight as well, for loads started elsewhere). Any exception becomes
a `LoRAError` naming the adapter, handed to exactly the requests that asked for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from loramux.engine.sequence import Sequence
from loramux.errors import LoRAError
from loramux.registry import LoRAAdapter, LoRARequest

__all__ = ["AdapterLoader", "LoadResult"]

LoadResult = tuple[Sequence, LoRAAdapter | None, LoRAError | None]


class AdapterLoader:
    """Loads for waiting requests, keyed by adapter name. Used from the step loop's thread only.

    :param load: ``load(lora_request) -> LoRAAdapter``: resolve, load and validate (runs in a
        worker thread; may block on I/O).
    :param max_workers: loads of different adapters that may run at once.
    """

    def __init__(self, load: Callable[[LoRARequest], LoRAAdapter], *, max_workers: int = 4) -> None:
        self._load = load
        # Daemon threads, not a ThreadPoolExecutor: its workers are joined at interpreter exit,
        # so one resolver hanging forever would keep a stopped server from exiting.
        self._workers = threading.BoundedSemaphore(max_workers)
        self._loads: dict[str, Future[LoRAAdapter]] = {}
        self._waiters: dict[str, list[Sequence]] = {}

    def __len__(self) -> int:
        """Requests waiting for a load."""
        return sum(len(w) for w in self._waiters.values())

    def submit(self, seq: Sequence) -> None:
        """Start (or join) the load of ``seq``'s adapter."""
        name = seq.lora_name
        assert name is not None, "a request without an adapter needs no load"
        if name not in self._loads:
            future: Future[LoRAAdapter] = Future()
            threading.Thread(
                target=self._run, args=(future, seq.lora_request), name=f"loramux-load-{name}", daemon=True
            ).start()
            self._loads[name] = future
            self._waiters[name] = []
        self._waiters[name].append(seq)

    def discard(self, seq: Sequence) -> bool:
        """Forget ``seq`` (aborted); its adapter's load carries on for the others."""
        waiters = self._waiters.get(seq.lora_name)
        if waiters and seq in waiters:
            waiters.remove(seq)
            return True
        return False

    def poll(self, timeout: float = 0.0) -> list[LoadResult]:
        """The requests whose load finished, with the adapter or the error; waits up to ``timeout``."""
        if timeout > 0 and self._loads and not any(f.done() for f in self._loads.values()):
            wait(list(self._loads.values()), timeout=timeout, return_when=FIRST_COMPLETED)
        results: list[LoadResult] = []
        for name in [n for n, f in self._loads.items() if f.done()]:
            future = self._loads.pop(name)
            error = future.exception()
            adapter = None if error is not None else future.result()
            for seq in self._waiters.pop(name):
                results.append((seq, adapter, error))
        return results

    def _run(self, future: Future[LoRAAdapter], request: LoRARequest) -> None:
        with self._workers:  # at most max_workers loads at once; the rest queue here
            if not future.set_running_or_notify_cancel():  # shut down meanwhile
                return
            try:
                future.set_result(_guarded(self._load, request))
            except BaseException as error:  # every waiter must hear of it, whatever it is
                future.set_exception(error)

    def shutdown(self) -> None:
        """Forget pending loads; their threads finish (or hang) on their own, as daemons."""
        for future in self._loads.values():
            future.cancel()
        self._loads.clear()
        self._waiters.clear()


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
