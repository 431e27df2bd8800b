"""`AdapterPlacement`: where an adapter goes in the GPU tier, and which resident ones make room.

The GPU tier's one eviction policy, the same for every caller (admission, prefetch, pins):

- a resident adapter no running request uses (nor a user pin) is a cache: the least recently
  used of those goes first, and only as many as the new adapter's slot and pool rows need (for
  rows, only one that owns rows in a layer where they are short);
- an adapter a running request or a user pin holds is never evicted, nor one kept for a request
  ahead in the queue (a prefetch's ``keep``);
- when the adapters in use leave no room, nothing is evicted: the new adapter waits (the
  scheduler keeps its requests queued, `Fit.NO_ROOM`) until a request ends; only one that could
  never fit beside the user-pinned adapters fails.

KV-cache pressure never evicts an adapter: the scheduler preempts the newest running sequence
(its adapter stays held while any other request of it runs). Both pressures are reported side by
side (`usage`, the KV cache's usage).

Room is asked every step a request waits, so answers are kept until the slot table changes
(`SlotTable.version`), and footprints per handle (a handle's weights never change). Not
thread-safe on its own: the model manager serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from loramux.engine.adapters.slots import SlotTable
from loramux.engine.layers.weight_pool import AdapterWeightPool, Footprint
from loramux.errors import CacheFullError
from loramux.registry import LoRAAdapter

__all__ = ["AdapterPlacement", "MAX_FOOTPRINTS"]

#: Footprints kept before the table starts over (a few KB each at 8B).
MAX_FOOTPRINTS = 4096


class AdapterPlacement:
    """The slots (``slots``) and pool rows (``pool``) of the resident adapters: whether one more
    fits, and what to evict for it (see the module docstring)."""

    def __init__(self, pool: AdapterWeightPool, slots: SlotTable) -> None:
        self.pool = pool
        self.slots = slots
        self._footprints: dict[int, Footprint] = {}  # handle id -> its footprint
        self._fit_answers: tuple[int, dict] = (-1, {})  # (the slot table's version, its answers)

    def footprint(self, adapter: LoRAAdapter) -> Footprint:
        """The pool rows ``adapter`` takes in each layer it touches (kept per handle)."""
        key = adapter.handle.id if adapter.handle is not None else None
        footprint = self._footprints.get(key) if key is not None else None
        if footprint is None:
            footprint = self.pool.footprint(adapter.modules)
            if key is not None:
                if len(self._footprints) >= MAX_FOOTPRINTS:
                    self._footprints.clear()  # handles come and go; this only bounds the table
                self._footprints[key] = footprint
        return footprint

    def kept(self, keep: Collection[int] = ()) -> set[int]:
        """Resident handle ids that may not be evicted: the held ones and those in ``keep``."""
        return set(self.slots.held()) | {i for i in keep if i in self.slots}

    def can_place(self, adapter: LoRAAdapter, keep: Collection[int] = ()) -> bool:
        """Whether ``adapter`` (not resident) would find a slot and its rows now, evicting only
        adapters neither held nor in ``keep``."""
        if len(self.kept(keep)) >= self.slots.num_slots:
            return False
        footprint = self.footprint(adapter)
        if self.slots.free_slots and self.pool.fits(footprint):
            return True  # room now: the common case, without walking what is resident
        return self._fits_once_evicted(footprint, keep, adapter.handle and adapter.handle.id)

    def fits_beside(self, adapter: LoRAAdapter, handle_ids: Collection[int]) -> bool:
        """Whether ``adapter`` would find a slot and its rows if only ``handle_ids`` stayed resident."""
        kept = {i for i in handle_ids if i in self.slots}
        if len(kept) >= self.slots.num_slots:
            return False
        return self.pool.fits_keeping(self.footprint(adapter), {self.slots.slot_of(i) for i in kept})

    def _fits_once_evicted(self, footprint: Footprint, keep: Collection[int] = (),
                           handle_id: int | None = None) -> bool:
        """Whether ``footprint`` fits every layer's rows left by the held adapters and ``keep``;
        kept per handle while the slot table stands (one answer walks the blocks of every
        adapter in use, in each group of layers)."""
        kept_ids = self.kept(keep)
        key = (handle_id, frozenset(kept_ids))
        if self._fit_answers[0] != self.slots.version:
            self._fit_answers = (self.slots.version, {})
        answer = self._fit_answers[1].get(key) if handle_id is not None else None
        if answer is None:
            answer = self.pool.fits_keeping(footprint, {self.slots.slot_of(i) for i in kept_ids})
            if handle_id is not None:
                self._fit_answers[1][key] = answer
        return answer

    def make_room(self, footprint: Footprint, label: str, keep: Collection[int],
                  evict: Callable[[int], None], name_of: Callable[[int], str]) -> None:
        """Evict (``evict(handle_id)``) the least recently used adapters neither held nor in
        ``keep`` until a slot is free and every layer of ``footprint`` has its rows free.

        :raises CacheFullError: the adapters in use leave no room (checked first: nothing is evicted).
        """
        if len(self.slots.held()) >= self.slots.num_slots:
            raise self.slots.full_error(label)
        if not self._fits_once_evicted(footprint, keep):
            held = [name_of(i) for i in self.slots.held()]
            raise CacheFullError(
                f"the adapters in use ({', '.join(held)}) leave no room for its weights in the GPU "
                f"LoRA memory ({self.pool.units} rank rows per layer, {self.pool.capacity_bytes:,} bytes).",
                adapter=label,
                fix="Retry when a request finishes, or raise max_gpu_lora_bytes (--max-gpu-lora-bytes).",
            )
        while True:
            short = self.pool.rows.short(footprint.rows)
            if self.slots.free_slots and not short:
                return
            # least recently used first; for rows, only an adapter that owns some where they are short
            evict(next(i for i in self.slots.ids() if not self.slots.is_held(i) and i not in keep
                       and (not self.slots.free_slots or any(self.slots.slot_of(i) in pool for pool in short))))

    @property
    def usage(self) -> float:
        """The GPU tier's pressure, 0 to 1: the fullest of its slots and its layers' rows (a layer
        whose rows are all taken refuses every adapter that touches it)."""
        return max(len(self.slots) / self.slots.num_slots, self.pool.rows_usage)
