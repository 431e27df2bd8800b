"""`LoadingThreads`: at most ``max_workers`` daemon threads that run adapter loads beside the step loop.

A ``ThreadPoolExecutor`` joins its workers at interpreter exit, so one resolver hanging forever
would keep a stopped server from exiting; these are daemons. Threads start as work arrives, up to
``max_workers``, take the queued loads in order and end once the queue is empty: an idle registry
holds no thread (nor does one keep a dropped registry alive).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["LoadingThreads"]


class LoadingThreads:
    """``submit(fn, *args) -> Future``, run by at most ``max_workers`` daemon threads."""

    def __init__(self, max_workers: int, name: str = "loramux-load") -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers: got {max_workers!r}; allowed: an int >= 1")
        self.max_workers = max_workers
        self._name = name
        self._lock = threading.Lock()
        self._pending: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._threads: list[threading.Thread] = []  # running now

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        thread = None
        with self._lock:
            self._pending.append((future, fn, args))
            if len(self._threads) < self.max_workers:  # else a running thread takes it when done
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads) + 1}",
                                          daemon=True)
                self._threads.append(thread)
        if thread is not None:
            thread.start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:  # a submit either sees this thread still running or starts another
                if not self._pending:
                    self._threads.remove(threading.current_thread())
                    return
                future, fn, args = self._pending.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # the caller reads it from the future
                    future.set_exception(error)
            del future, fn, args  # nothing of a finished load stays in this frame

    def shutdown(self, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` seconds for the loads queued so far to end (a hung one is a
        daemon: it ends with the process)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
