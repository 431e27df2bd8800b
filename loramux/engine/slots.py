"""The GPU slot tier's bookkeeping: which adapter sits in which of the ``max_loras`` slots.

Modelled on nano-vllm's ``block_manager.py``: a plain class, a deque of free slots, reference
counts (pins) for what the batch in flight uses, the vocabulary ``can_allocate / allocate /
deallocate``, and asserts on its invariants. It holds no tensors; `LoRAModelManager` copies the
weights. Not thread-safe on its own: the manager serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from loramux.errors import CacheFullError

__all__ = ["SlotTable"]


class SlotTable:
    """``num_slots`` slots, least recently used evicted first, pinned adapters never.

    :param num_slots: how many adapters fit at once (``max_loras``).
    """

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1, f"num_slots must be >= 1, got {num_slots}"
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self._pins: dict[str, int] = {}  # name -> pin count (absent = 0)

    # -- lookups ---------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def names(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._slots)

    def name_in(self, slot: int) -> str | None:
        for name, held in self._slots.items():
            if held == slot:
                return name
        return None

    def is_pinned(self, name: str) -> bool:
        return self._pins.get(name, 0) > 0

    def pinned(self) -> list[str]:
        return [name for name in self._slots if self.is_pinned(name)]

    def victim(self) -> str | None:
        """The adapter `allocate` would evict now, or None when a slot is free or all are pinned."""
        if self.free_slots:
            return None
        return next((name for name in self._slots if not self.is_pinned(name)), None)

    # -- allocation -------------------------------------------------------------------------

    def can_allocate(self) -> bool:
        """Whether `allocate` would succeed: a free slot, or a resident adapter nobody pins."""
        return bool(self.free_slots) or self.victim() is not None

    def allocate(self, name: str) -> tuple[int, str | None]:
        """Give ``name`` a slot: a free one, else the least recently used unpinned one.

        :returns: ``(slot, evicted)``, ``evicted`` being the adapter that held the slot, if any.
        :raises CacheFullError: every slot holds a pinned adapter.
        """
        assert name not in self._slots, f"{name!r} already holds slot {self._slots[name]}"
        evicted = None
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            evicted = self.victim()
            if evicted is None:
                raise CacheFullError(
                    f"all {self.num_slots} GPU LoRA slots hold adapters in use by running "
                    f"requests ({', '.join(self.pinned())}).",
                    adapter=name,
                    fix="Retry when a request finishes, or raise max_loras (--max-loras).",
                )
            slot = self._slots.pop(evicted)
        self._slots[name] = slot
        self._check()
        return slot, evicted

    def deallocate(self, name: str) -> int:
        """Free ``name``'s slot and return it; ``name`` must not be pinned."""
        assert name in self._slots, f"{name!r} holds no slot"
        assert not self.is_pinned(name), f"{name!r} is pinned by a running request"
        slot = self._slots.pop(name)
        self.free_slots.append(slot)
        self._check()
        return slot

    def drop(self, name: str) -> int:
        """Free ``name``'s slot even if pinned (its copy failed half way, so it must not be used)."""
        self._pins.pop(name, None)
        return self.deallocate(name)

    def touch(self, name: str) -> None:
        """Mark ``name`` as just used (moves it last in the eviction order)."""
        self._slots.move_to_end(name)

    # -- pins ------------------------------------------------------------------------------

    def pin(self, name: str) -> None:
        assert name in self._slots, f"{name!r} holds no slot"
        self._pins[name] = self._pins.get(name, 0) + 1

    def unpin(self, name: str) -> None:
        count = self._pins.get(name, 0)
        assert count > 0, f"{name!r} is not pinned"
        if count == 1:
            del self._pins[name]
        else:
            self._pins[name] = count - 1

    def _check(self) -> None:
        assert len(self._slots) + len(self.free_slots) == self.num_slots
        assert len(set(self._slots.values())) == len(self._slots), "two adapters share a slot"
        assert set(self._pins) <= set(self._slots), "a pin outlived its slot"
