"""The GPU slot tier's bookkeeping: which adapter handle sits in which of the ``max_loras`` slots.

Modelled on nano-vllm's ``block_manager.py``: a plain class, a deque of free slots, the
vocabulary ``can_allocate / allocate / deallocate``, and asserts on its invariants. It holds no
tensors; `LoRAModelManager` copies the weights. Not thread-safe on its own: the manager
serialises calls.

Slots are keyed by :attr:`AdapterHandle.id <loramux.registry.AdapterHandle.id>`. Whether a
slot is *in use* is not counted here: the scheduler's per-handle reference count is the one
owner of that number, and it tells this table only the transitions (``hold`` when a handle
gains its first running request or user pin, ``release`` when it loses its last). A held slot
is never evicted; a released one stays resident as a cache, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from loramux.errors import CacheFullError

__all__ = ["SlotTable"]


class SlotTable:
    """``num_slots`` slots, least recently used evicted first, held ones never.

    :param num_slots: how many adapters fit at once (``max_loras``).
    """

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1, f"num_slots must be >= 1, got {num_slots}"
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self._slots: OrderedDict[int, int] = OrderedDict()  # handle id -> slot, least recent first
        self._held: set[int] = set()  # handle ids the batch in flight (or a user pin) uses
        self.version = 0  # bumped on every change (an answer about the table stands until then)

    # -- lookups ---------------------------------------------------------------------------

    def __contains__(self, handle_id: int) -> bool:
        return handle_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, handle_id: int) -> int | None:
        return self._slots.get(handle_id)

    def ids(self) -> list[int]:
        """Resident handle ids, least recently used first."""
        return list(self._slots)

    def id_in(self, slot: int) -> int | None:
        """The handle id whose weights are in ``slot``, or None for a free slot."""
        for handle_id, held in self._slots.items():
            if held == slot:
                return handle_id
        return None

    def is_held(self, handle_id: int) -> bool:
        return handle_id in self._held

    def held(self) -> list[int]:
        return [handle_id for handle_id in self._slots if handle_id in self._held]

    def victim(self) -> int | None:
        """The handle `allocate` would evict now, or None when a slot is free or all are held."""
        if self.free_slots:
            return None
        return self.least_recent_unheld()

    def least_recent_unheld(self) -> int | None:
        """The least recently used resident handle nobody holds, or None."""
        return next((i for i in self._slots if i not in self._held), None)

    # -- allocation -------------------------------------------------------------------------

    def can_allocate(self) -> bool:
        """Whether `allocate` would succeed: a free slot, or a resident handle nobody holds."""
        return bool(self.free_slots) or self.victim() is not None

    def allocate(self, handle_id: int, *, label: str | None = None) -> tuple[int, int | None]:
        """Give ``handle_id`` a slot: a free one, else the least recently used one not held.

        :param label: how to name the adapter in an error (its name).
        :returns: ``(slot, evicted)``, ``evicted`` being the handle id that held the slot, if any.
        :raises CacheFullError: every slot is held.
        """
        assert handle_id not in self._slots, f"handle {handle_id} already holds slot {self._slots[handle_id]}"
        evicted = None
        if self.free_slots:
            slot = self.free_slots.popleft()
        else:
            evicted = self.victim()
            if evicted is None:
                raise self.full_error(label if label is not None else str(handle_id))
            slot = self._slots.pop(evicted)
        self._slots[handle_id] = slot
        self.version += 1
        self._check()
        return slot, evicted

    def full_error(self, label: str) -> CacheFullError:
        """The error for an adapter that finds every slot held."""
        return CacheFullError(
            f"all {self.num_slots} GPU LoRA slots hold adapters in use by running "
            f"requests or pinned (handles {', '.join(map(str, self.held()))}).",
            adapter=label,
            fix="Retry when a request finishes, or raise max_loras (--max-loras).",
        )

    def deallocate(self, handle_id: int) -> int:
        """Free ``handle_id``'s slot and return it; it must not be held."""
        assert handle_id in self._slots, f"handle {handle_id} holds no slot"
        assert handle_id not in self._held, f"handle {handle_id} is held by running requests"
        slot = self._slots.pop(handle_id)
        self.free_slots.append(slot)
        self.version += 1
        self._check()
        return slot

    def drop(self, handle_id: int) -> int:
        """Free ``handle_id``'s slot even if held (its copy failed half way, so it must not be used)."""
        self._held.discard(handle_id)
        return self.deallocate(handle_id)

    def touch(self, handle_id: int) -> None:
        """Mark ``handle_id`` as just used (moves it last in the eviction order)."""
        self._slots.move_to_end(handle_id)

    # -- in use (told by the scheduler, which counts) ---------------------------------------

    def hold(self, handle_id: int) -> None:
        """``handle_id`` is in use from now on: never evict it until :meth:`release`."""
        assert handle_id in self._slots, f"handle {handle_id} holds no slot"
        assert handle_id not in self._held, f"handle {handle_id} is already held"
        self._held.add(handle_id)
        self.version += 1

    def release(self, handle_id: int) -> None:
        """``handle_id`` is no longer in use; its slot stays resident, evictable."""
        assert handle_id in self._held, f"handle {handle_id} is not held"
        self._held.discard(handle_id)
        self.version += 1

    def _check(self) -> None:
        assert len(self._slots) + len(self.free_slots) == self.num_slots
        assert len(set(self._slots.values())) == len(self._slots), "two adapters share a slot"
        assert self._held <= set(self._slots), "a hold outlived its slot"
