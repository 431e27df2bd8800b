"""The registry's loading threads: loads run in order on at most ``max_workers`` threads, a thread
waits a moment for the next load before it ends, and shutdown ends the idle ones at once."""

from __future__ import annotations

import threading
import time

import pytest

from loramux.registry.loading_threads import IDLE_SECONDS, LoadingThreads


def running(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name) and t.is_alive()]


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_load_soon_after_another_runs_on_the_same_thread_and_the_thread_ends_when_idle():
    threads = LoadingThreads(2, name="lt-idle")
    first = threads.submit(lambda: threading.current_thread())
    ran_on = first.result(timeout=5)
    assert wait_until(lambda: threads._queue.idle == 1)  # it waits for the next load
    assert threads.submit(lambda: threading.current_thread()).result(timeout=5) is ran_on  # no new thread
    started = time.monotonic()
    assert wait_until(lambda: not running("lt-idle"), 5 * IDLE_SECONDS)
    assert time.monotonic() - started >= 0.5 * IDLE_SECONDS


def test_loads_queued_past_the_idle_threads_start_more_up_to_max_workers():
    threads = LoadingThreads(3, name="lt-burst")
    gate = threading.Event()
    names = [threads.submit(lambda: (gate.wait(5), threading.current_thread().name)[1]) for _ in range(5)]
    assert wait_until(lambda: len(running("lt-burst")) == 3)
    gate.set()
    assert {f.result(timeout=5) for f in names} == {"lt-burst-1", "lt-burst-2", "lt-burst-3"}
    threads.shutdown()
    assert not running("lt-burst")


def test_shutdown_ends_idle_threads_at_once_and_finishes_queued_loads_and_a_later_submit_runs():
    threads = LoadingThreads(1, name="lt-stop")
    gate = threading.Event()
    slow = threads.submit(lambda: gate.wait(5) and "slow")
    queued = threads.submit(lambda: "queued")
    threading.Timer(0.05, gate.set).start()
    started = time.monotonic()
    threads.shutdown(timeout=5)
    assert (slow.result(timeout=0), queued.result(timeout=0)) == ("slow", "queued")
    assert time.monotonic() - started < IDLE_SECONDS and not running("lt-stop")
    assert threads.submit(lambda: "again").result(timeout=5) == "again"
    threads.shutdown()
    assert not running("lt-stop")


def test_dropping_the_owner_ends_its_idle_threads_at_once():
    """The threads hold the queue, not their owner: a registry dropped without a shutdown is freed
    and leaves no thread waiting."""
    import weakref

    threads = LoadingThreads(2, name="lt-drop")
    assert threads.submit(lambda: 1).result(timeout=5) == 1
    owner = weakref.ref(threads)
    started = time.monotonic()
    del threads
    assert owner() is None  # reference counts alone
    assert wait_until(lambda: not running("lt-drop"), IDLE_SECONDS)
    assert time.monotonic() - started < 0.5 * IDLE_SECONDS


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    threads = LoadingThreads(1, name="lt-error")

    def fail():
        raise ValueError("bad adapter")

    with pytest.raises(ValueError, match="bad adapter"):
        threads.submit(fail).result(timeout=5)
    assert threads.submit(lambda: 7).result(timeout=5) == 7
    threads.shutdown()
