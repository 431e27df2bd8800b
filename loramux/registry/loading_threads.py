"""`LoadingThreads`: at most ``max_workers`` daemon threads that run adapter loads beside the step loop.

A ``ThreadPoolExecutor`` joins its workers at interpreter exit, so one resolver hanging forever
would keep a stopped server from exiting; these are daemons. Threads start as work arrives, up to
``max_workers``, take the queued loads in order, and end once the queue has stayed empty for
`IDLE_SECONDS`: a load that comes in the meantime wakes one (starting a thread is part of a cold
request's time to first token). They share only the queue with their owner, so they never keep a
dropped registry alive, and an owner that is shut down or dropped ends its idle threads at once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["IDLE_SECONDS", "LoadingThreads"]

#: How long a thread with nothing to load waits for the next load before it ends.
IDLE_SECONDS = 1.0


class _Queue:
    """What the threads share with their owner: the loads queued and the threads taking them."""

    def __init__(self) -> None:
        self.work_queued = threading.Condition()
        self.pending: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self.threads: list[threading.Thread] = []  # running now
        self.idle = 0  # of those, waiting for work
        self.closing = False  # the idle ones end now

    def close(self) -> None:
        with self.work_queued:
            self.closing = True
            self.work_queued.notify_all()


def _work(queue: _Queue) -> None:
    """A loading thread: take the queued loads in order; end once none came for `IDLE_SECONDS`."""
    while True:
        with queue.work_queued:  # a submit either sees this thread still running or starts another
            if not queue.pending and not queue.closing:
                queue.idle += 1
                queue.work_queued.wait_for(lambda: queue.pending or queue.closing, IDLE_SECONDS)
                queue.idle -= 1
            if not queue.pending:
                queue.threads.remove(threading.current_thread())
                return
            future, fn, args = queue.pending.popleft()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # the caller reads it from the future
                future.set_exception(error)
        del future, fn, args  # nothing of a finished load stays in this frame


class LoadingThreads:
    """``submit(fn, *args) -> Future``, run by at most ``max_workers`` daemon threads."""

    def __init__(self, max_workers: int, name: str = "loramux-load") -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers: got {max_workers!r}; allowed: an int >= 1")
        self.max_workers = max_workers
        self._name = name
        self._queue = _Queue()
        weakref.finalize(self, self._queue.close)  # dropped: its idle threads end now

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        queue, thread = self._queue, None
        with queue.work_queued:
            queue.closing = False
            queue.pending.append((future, fn, args))
            # an idle thread takes it; more loads queued than idle threads: one more thread
            if len(queue.pending) > queue.idle and len(queue.threads) < self.max_workers:
                thread = threading.Thread(target=_work, args=(queue,), name=f"{self._name}-{len(queue.threads) + 1}",
                                          daemon=True)
                queue.threads.append(thread)
            queue.work_queued.notify()
        if thread is not None:
            thread.start()
        return future

    def shutdown(self, timeout: float = 1.0) -> None:
        """End the idle threads now and wait up to ``timeout`` seconds for the loads queued so far
        to end (a hung one is a daemon: it ends with the process). A later `submit` starts threads
        again."""
        deadline = time.monotonic() + timeout
        self._queue.close()
        with self._queue.work_queued:
            threads = list(self._queue.threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
