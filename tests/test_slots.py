"""SlotTable: the GPU slot tier's bookkeeping (free slots, LRU, held slots), keyed by handle id."""

import pytest

from loramux.engine.adapters.slots import SlotTable
from loramux.errors import CacheFullError


def test_free_slots_first_then_least_recently_used():
    table = SlotTable(2)
    assert table.allocate(10) == (0, None)
    assert table.allocate(11) == (1, None)
    table.touch(10)
    assert table.ids() == [11, 10] and table.victim() == 11
    assert table.allocate(12) == (1, 11)  # the evicted handle's slot is reused
    assert table.ids() == [10, 12] and 11 not in table and table.slot_of(12) == 1


def test_held_slots_are_never_evicted():
    table = SlotTable(2)
    table.allocate(1)
    table.allocate(2)
    table.hold(1)
    assert table.allocate(3) == (1, 2)  # 1 is older but held
    table.hold(3)
    assert not table.can_allocate() and table.victim() is None
    with pytest.raises(CacheFullError, match=r"adapter 'four'.*all 2 GPU LoRA slots.*handles 1, 3.*--max-loras"):
        table.allocate(4, label="four")
    assert table.ids() == [1, 3]  # nothing changed
    table.release(3)
    assert table.can_allocate() and table.allocate(4) == (1, 3)


def test_deallocate_returns_the_slot():
    table = SlotTable(3)
    for handle_id in (1, 2, 3):
        table.allocate(handle_id)
    assert table.deallocate(2) == 1
    assert list(table.free_slots) == [1] and table.ids() == [1, 3]
    assert table.allocate(4) == (1, None)
    assert table.id_in(1) == 4 and table.id_in(5) is None


def test_invariants_are_asserted():
    table = SlotTable(1)
    table.allocate(1)
    with pytest.raises(AssertionError):
        table.allocate(1)
    table.hold(1)
    with pytest.raises(AssertionError, match="already held"):
        table.hold(1)  # the scheduler counts; the table hears each transition once
    with pytest.raises(AssertionError, match="held by running requests"):
        table.deallocate(1)
    assert table.drop(1) == 0 and not table.is_held(1)  # a failed copy frees it anyway
    with pytest.raises(AssertionError):
        table.release(1)
    with pytest.raises(AssertionError):
        table.hold(1)
