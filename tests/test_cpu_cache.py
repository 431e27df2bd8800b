"""The CPU tier: keyed by handle id, LRU order, count and byte budgets (mixed ranks), pins,
retirement of old handles, and failed inserts that change nothing."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loramux.errors import CacheFullError, LoRAError
from loramux.registry import AdapterHandle, CPUAdapterCache, LoRAAdapter, LoRAModuleWeights
from loramux.registry.handle import next_handle_id


def fake_adapter(name: str, rank: int = 2, width: int = 8) -> LoRAAdapter:
    weights = LoRAModuleWeights(torch.randn(rank, width), torch.randn(width, rank), 2.0)
    adapter = LoRAAdapter(name, Path(name), {"layer": weights}, lora_alpha=4, target_modules=["layer"])
    handle = AdapterHandle(next_handle_id(), name, f"digest-{name}", None, rank, adapter.nbytes)
    return replace(adapter, handle=handle)


def fill(cache: CPUAdapterCache, *names: str, **kwargs) -> dict[str, int]:
    """Insert one adapter per name; returns name -> handle id."""
    ids = {}
    for name in names:
        adapter = fake_adapter(name, **kwargs)
        cache.put(adapter)
        ids[name] = adapter.handle.id
    return ids


def test_least_recently_used_goes_first_and_eviction_names_the_handle():
    evicted = []
    cache = CPUAdapterCache(2, on_evict=evicted.append)
    ids = fill(cache, "a", "b")
    assert cache.get(ids["a"]) is not None  # "b" is now the oldest
    ids |= fill(cache, "c")
    assert cache.handle_ids() == [ids["a"], ids["c"]] and cache.names() == ["a", "c"]
    assert [handle.id for handle in evicted] == [ids["b"]]
    assert cache.stats.evictions == 1 and cache.stats.loads == 3
    assert cache.get(ids["b"]) is None and cache.stats.misses == 1 and cache.stats.hits == 1


def test_byte_budget_with_mixed_ranks_evicts_as_many_small_ones_as_a_large_one_needs():
    small = fake_adapter("probe", rank=8).nbytes
    cache = CPUAdapterCache(100, max_bytes=4 * small)
    ids = fill(cache, "s1", "s2", "s3", "s4", rank=8)
    assert cache.nbytes == 4 * small and len(cache) == 4
    large = fake_adapter("large", rank=24)  # three small ones' worth
    evicted = cache.put(large)
    assert [h.name for h in evicted] == ["s1", "s2", "s3"]
    assert cache.handle_ids() == [ids["s4"], large.handle.id]
    assert cache.nbytes == 4 * small <= cache.max_bytes


def test_an_adapter_larger_than_the_whole_budget_is_refused_and_nothing_changes():
    cache = CPUAdapterCache(10, max_bytes=2 * fake_adapter("x").nbytes)
    ids = fill(cache, "a", "b")
    with pytest.raises(CacheFullError) as caught:
        cache.put(fake_adapter("huge", rank=64))
    message = str(caught.value)
    assert caught.value.adapter == "huge" and "more than the CPU tier's whole budget" in message
    assert "--max-cpu-lora-bytes" in message
    assert cache.handle_ids() == list(ids.values())


def test_pinned_adapters_are_never_evicted_by_count_or_bytes():
    one = fake_adapter("x").nbytes
    cache = CPUAdapterCache(2, max_bytes=2 * one)
    ids = fill(cache, "a", "b")
    cache.pin(ids["a"])
    ids |= fill(cache, "c")
    assert cache.handle_ids() == [ids["a"], ids["c"]]
    cache.pin(ids["c"])
    with pytest.raises(CacheFullError, match="full of adapters in use") as caught:
        fill(cache, "d")
    assert caught.value.adapter == "d" and "--max-cpu-loras" in str(caught.value)
    assert cache.handle_ids() == [ids["a"], ids["c"]]  # the failed insert changed nothing
    cache.unpin(ids["c"])
    ids |= fill(cache, "d")
    assert cache.handle_ids() == [ids["a"], ids["d"]]


def test_pins_nest_and_misuse_is_an_error_naming_the_handle():
    cache = CPUAdapterCache(1)
    ids = fill(cache, "a")
    cache.pin(ids["a"])
    cache.pin(ids["a"])
    cache.unpin(ids["a"])
    assert cache.is_pinned(ids["a"]) and cache.pin_count(ids["a"]) == 1
    cache.unpin(ids["a"])
    assert not cache.is_pinned(ids["a"])
    with pytest.raises(LoRAError, match=f"cannot unpin adapter handle {ids['a']}: it is not pinned"):
        cache.unpin(ids["a"])
    with pytest.raises(LoRAError, match="cannot pin adapter handle 999999: it is not in the CPU tier"):
        cache.pin(999999)


def test_get_and_put_can_pin_atomically():
    cache = CPUAdapterCache(1)
    adapter = fake_adapter("a")
    cache.put(adapter, pin=True)
    assert cache.is_pinned(adapter.handle.id)
    with pytest.raises(CacheFullError):
        fill(cache, "b")
    assert cache.get(adapter.handle.id, pin=True) is adapter
    assert cache.pin_count(adapter.handle.id) == 2


def test_an_adapter_without_a_handle_is_refused():
    adapter = replace(fake_adapter("a"), handle=None)
    with pytest.raises(ValueError, match="'a' has no handle; the Registry issues them"):
        CPUAdapterCache(1).put(adapter)


def test_two_handles_of_one_name_are_two_entries():
    cache = CPUAdapterCache(4)
    old, new = fake_adapter("same"), fake_adapter("same")
    cache.put(old)
    cache.put(new)
    assert cache.names() == ["same", "same"] and cache.get(old.handle.id) is old
    assert cache.get(new.handle.id) is new


def test_a_retired_handle_stays_while_pinned_and_leaves_at_its_last_unpin():
    gone = []
    cache = CPUAdapterCache(4, on_evict=gone.append)
    ids = fill(cache, "running", "idle")
    cache.pin(ids["running"])
    cache.pin(ids["running"])
    assert cache.retire(ids["idle"]) is True and ids["idle"] not in cache  # nobody holds it
    assert cache.retire(ids["running"]) is False and ids["running"] in cache
    cache.unpin(ids["running"])
    assert ids["running"] in cache  # one request still runs on it
    cache.unpin(ids["running"])
    assert ids["running"] not in cache and len(cache) == 0 and cache.nbytes == 0
    assert [h.id for h in gone] == [ids["idle"], ids["running"]]
    assert cache.retire(ids["running"]) is False  # already gone


def test_remove_drops_the_adapter_and_its_pins():
    cache = CPUAdapterCache(2)
    ids = fill(cache, "a")
    cache.pin(ids["a"])
    assert cache.remove(ids["a"]) and not cache.remove(ids["a"])
    assert ids["a"] not in cache and not cache.is_pinned(ids["a"]) and cache.nbytes == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_loras=0), "max_loras: got 0; allowed: an int >= 1"),
        (dict(max_loras=True), "max_loras: got True"),
        (dict(max_loras=2, max_bytes=0), "max_bytes: got 0; allowed: an int >= 1 or None"),
        (dict(max_loras=2, max_bytes=1.5), "max_bytes: got 1.5"),
    ],
)
def test_bad_bounds_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CPUAdapterCache(**kwargs)
