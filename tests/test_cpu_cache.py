"""The CPU tier: LRU order, budgets, pins, single-flight loading, failed loads change nothing."""

import threading
import time
from pathlib import Path

import pytest
import torch

from loramux.errors import CacheFullError, InvalidAdapterError, LoRAError
from loramux.registry import CPUAdapterCache, LoRAAdapter, LoRAModuleWeights


def fake_adapter(name: str, rank: int = 2, width: int = 8) -> LoRAAdapter:
    weights = LoRAModuleWeights(torch.randn(rank, width), torch.randn(width, rank), 2.0)
    return LoRAAdapter(name, Path(name), {"layer": weights}, lora_alpha=4, target_modules=["layer"])


def fill(cache: CPUAdapterCache, *names: str, **kwargs) -> None:
    for name in names:
        cache.get_or_load(name, lambda name=name: fake_adapter(name, **kwargs))


def test_least_recently_used_goes_first():
    evicted = []
    cache = CPUAdapterCache(2, pin_memory=False, on_evict=evicted.append)
    fill(cache, "a", "b")
    assert cache.get("a") is not None  # "b" is now the oldest
    fill(cache, "c")
    assert cache.names() == ["a", "c"] and evicted == ["b"]
    assert cache.stats.evictions == 1 and cache.stats.loads == 3
    assert cache.get("b") is None and cache.stats.misses >= 1


def test_byte_budget_bounds_the_tier():
    one = fake_adapter("x").nbytes
    cache = CPUAdapterCache(10, max_bytes=2 * one, pin_memory=False)
    fill(cache, "a", "b", "c")
    assert cache.names() == ["b", "c"] and cache.nbytes == 2 * one
    with pytest.raises(CacheFullError, match="more than the CPU tier's whole budget"):
        cache.get_or_load("huge", lambda: fake_adapter("huge", rank=64))
    assert cache.names() == ["b", "c"]


def test_pinned_adapters_are_never_evicted():
    cache = CPUAdapterCache(2, pin_memory=False)
    fill(cache, "a", "b")
    cache.pin("a")
    fill(cache, "c")
    assert cache.names() == ["a", "c"]
    cache.pin("c")
    with pytest.raises(CacheFullError, match="full of adapters in use") as excinfo:
        fill(cache, "d")
    assert excinfo.value.adapter == "d" and "max_cpu_loras" in str(excinfo.value)
    assert cache.names() == ["a", "c"]  # the failed insert changed nothing
    cache.unpin("c")
    fill(cache, "d")
    assert cache.names() == ["a", "d"]


def test_pins_nest_and_misuse_is_an_error():
    cache = CPUAdapterCache(1, pin_memory=False)
    fill(cache, "a")
    cache.pin("a")
    cache.pin("a")
    cache.unpin("a")
    assert cache.is_pinned("a")
    cache.unpin("a")
    assert not cache.is_pinned("a")
    with pytest.raises(LoRAError, match="not pinned"):
        cache.unpin("a")
    with pytest.raises(LoRAError, match="not loaded"):
        cache.pin("missing")


def test_get_or_load_can_pin_atomically():
    cache = CPUAdapterCache(1, pin_memory=False)
    cache.get_or_load("a", lambda: fake_adapter("a"), pin=True)
    assert cache.is_pinned("a")
    with pytest.raises(CacheFullError):
        fill(cache, "b")


def test_put_replaces_in_place_and_keeps_pins():
    cache = CPUAdapterCache(2, pin_memory=False)
    fill(cache, "a")
    cache.pin("a")
    replacement = fake_adapter("a", rank=3)
    cache.put("a", replacement)
    assert cache.get("a") is replacement and cache.is_pinned("a") and len(cache) == 1


def test_single_flight_loads_once_for_many_threads():
    cache = CPUAdapterCache(4, pin_memory=False)
    calls = []
    release = threading.Event()

    def slow_load():
        calls.append(1)
        release.wait(5)
        return fake_adapter("a")

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_load("a", slow_load)))
        for _ in range(16)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # let every thread reach the in-flight load
    release.set()
    for thread in threads:
        thread.join(5)
    assert len(calls) == 1 and len(results) == 16
    assert all(result is results[0] for result in results)


def test_failed_load_reaches_every_waiter_and_changes_nothing():
    cache = CPUAdapterCache(2, pin_memory=False)
    fill(cache, "ok")
    release = threading.Event()

    def failing_load():
        release.wait(5)
        raise InvalidAdapterError("corrupt weights", adapter="bad")

    errors = []

    def worker():
        try:
            cache.get_or_load("bad", failing_load)
        except InvalidAdapterError as error:
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    release.set()
    for thread in threads:
        thread.join(5)
    assert len(errors) == 8 and all("corrupt weights" in str(e) for e in errors)
    assert cache.names() == ["ok"] and cache.stats.load_failures == 1
    # A later attempt loads afresh (the failure was not cached) and the tier still works.
    assert cache.get_or_load("bad", lambda: fake_adapter("bad")).name == "bad"
    assert cache.names() == ["ok", "bad"]


def test_remove_drops_adapter_and_pins():
    cache = CPUAdapterCache(2, pin_memory=False)
    fill(cache, "a")
    cache.pin("a")
    assert cache.remove("a") and not cache.remove("a")
    assert "a" not in cache and not cache.is_pinned("a")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
@pytest.mark.gpu
def test_pinned_host_memory_with_cuda():
    cache = CPUAdapterCache(1)
    adapter = cache.get_or_load("a", lambda: fake_adapter("a"))
    assert adapter.modules["layer"].lora_a.is_pinned()
