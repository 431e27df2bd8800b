"""Resolve and load adapters beside the step loop, in a thread pool; a failure fails only its requests.

The step loop hands over each request whose adapter it has not seen ready and, at the top of
every step, collects the loads that finished. Requests for the same adapter share one load
(the registry below is single-flight as well, for loads started elsewhere). Any exception becomes
a `LoRAError` naming the adapter, handed to exactly the requests that asked for it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

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
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="loramux-adapter")
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
            self._loads[name] = self._pool.submit(_guarded, self._load, seq.lora_request)
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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
