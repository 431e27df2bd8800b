"""SlotTable: the GPU slot tier's bookkeeping (free slots, LRU, pins)."""

import pytest

from loramux.engine.slots import SlotTable
from loramux.errors import CacheFullError


def test_free_slots_first_then_least_recently_used():
    table = SlotTable(2)
    assert table.allocate("a") == (0, None)
    assert table.allocate("b") == (1, None)
    table.touch("a")
    assert table.names() == ["b", "a"] and table.victim() == "b"
    assert table.allocate("c") == (1, "b")  # the evicted adapter's slot is reused
    assert table.names() == ["a", "c"] and "b" not in table and table.slot_of("c") == 1


def test_pinned_adapters_are_never_evicted():
    table = SlotTable(2)
    table.allocate("a")
    table.allocate("b")
    table.pin("a")
    assert table.allocate("c") == (1, "b")  # a is older but pinned
    table.pin("c")
    table.pin("c")
    assert not table.can_allocate() and table.victim() is None
    with pytest.raises(CacheFullError, match=r"adapter 'd'.*all 2 GPU LoRA slots.*a, c.*--max-loras"):
        table.allocate("d")
    assert table.names() == ["a", "c"]  # nothing changed
    table.unpin("c")
    assert table.is_pinned("c") and not table.can_allocate()
    table.unpin("c")
    assert table.can_allocate() and table.allocate("d") == (1, "c")


def test_deallocate_returns_the_slot():
    table = SlotTable(3)
    for name in "abc":
        table.allocate(name)
    assert table.deallocate("b") == 1
    assert list(table.free_slots) == [1] and table.names() == ["a", "c"]
    assert table.allocate("d") == (1, None)
    assert table.name_in(1) == "d" and table.name_in(5) is None


def test_invariants_are_asserted():
    table = SlotTable(1)
    table.allocate("a")
    with pytest.raises(AssertionError):
        table.allocate("a")
    table.pin("a")
    with pytest.raises(AssertionError, match="pinned"):
        table.deallocate("a")
    assert table.drop("a") == 0 and not table.is_pinned("a")  # a failed copy frees it anyway
    with pytest.raises(AssertionError):
        table.unpin("a")
    with pytest.raises(AssertionError):
        table.pin("a")
