"""`AdapterUses`: who uses each adapter handle now, and whether a queued one may run: the small
interface the scheduler asks about adapters.

The counts are the one owner of "in use". A sequence references its adapter's handle from the
moment it is queued with it until it finishes (`reference` / `unreference`); a running sequence,
or a user pin (``pin_lora``), also needs the handle's GPU slot, held from the first such use to
the last (`start` / `stop`, `pin` / `unpin`). `fit` answers for a queued adapter whether it may
run now (`Fit`).

This class alone keeps the counts for an engine without tiers (every adapter fits, in slot 0);
`loramux.engine.adapters.lifecycle.AdapterLifecycle` puts the tiers behind the same transitions by
overriding the hooks (``_referenced``, ``_place``, ``_ended``, ``_released``, ``_has_room``,
``_fits_beside``, ``_is_placed``): a handle's first reference pins it in the CPU tier, its first
use of a slot places it on the GPU, and its last reference releases it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from loramux.registry import AdapterHandle

__all__ = ["AdapterUse", "AdapterUses", "Fit"]


class Fit(enum.Enum):
    """What a queued adapter not in a GPU slot may do now."""

    READY = "ready"  # room, and its weights sit in a slot already: it may run
    COPYING = "copying"  # room, but not placed yet: the copy beside the step puts it there
    NO_ROOM = "no_room"  # no room (rows, or max_loras) beside the adapters in use: it waits for one to end
    NEVER = "never"  # no room even beside the user-pinned adapters alone: it can never run


@dataclass
class AdapterUse:
    """Who uses one adapter handle now, split by what each use needs."""

    handle: AdapterHandle
    sequences: int = 0  # queued or running sequences with this handle (each needs its weights)
    running: int = 0  # of those, running (each needs its GPU slot)
    user_pins: int = 0  # pin_lora: a reference the engine holds (weights and slot)
    slot: int | None = None  # its GPU slot while it needs one

    @property
    def references(self) -> int:
        return self.sequences + self.user_pins

    @property
    def needs_slot(self) -> bool:
        return self.running + self.user_pins > 0


class AdapterUses:
    """The reference counts of the adapters in use, and what the scheduler asks of them.

    :param max_loras: a cap on the adapters in use in one step, pins included (None: no count
        binds; the tiers behind the hooks say whether there is room, `_has_room`).
    """

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self._uses: dict[int, AdapterUse] = {}  # handle id -> its uses; absent = no reference

    # -- what the scheduler asks --------------------------------------------------------------

    def in_slots(self) -> set[int]:
        """Handle ids that hold a GPU slot now (running sequences or user pins)."""
        return {i for i, use in self._uses.items() if use.needs_slot}

    def pinned(self) -> set[int]:
        """Handle ids the user pinned (``pin_lora``)."""
        return {i for i, use in self._uses.items() if use.user_pins}

    def running(self, handle_id: int) -> int:
        use = self._uses.get(handle_id)
        return 0 if use is None else use.running

    def references(self, handle_id: int) -> int:
        """Sequences and user pins that use ``handle_id`` now (0: none, it may retire)."""
        use = self._uses.get(handle_id)
        return 0 if use is None else use.references

    def name(self, handle_id: int) -> str:
        return self._uses[handle_id].handle.name

    def __bool__(self) -> bool:
        """Whether any handle is referenced."""
        return bool(self._uses)

    def has_room(self, handle: AdapterHandle, in_slots: set[int]) -> bool:
        """Whether ``handle``, not in a slot, would find room beside the handles in ``in_slots``."""
        return (self.max_loras is None or len(in_slots) < self.max_loras) and self._has_room(handle)

    def fit(self, handle: AdapterHandle, in_slots: set[int], pinned: set[int]) -> Fit:
        """Whether a queued ``handle`` that holds no slot may run now (see `Fit`)."""
        if self.has_room(handle, in_slots):
            return Fit.READY if self._is_placed(handle) else Fit.COPYING
        return Fit.NO_ROOM if self._fits_beside(handle, pinned) else Fit.NEVER

    # -- the scheduler's transitions ----------------------------------------------------------

    def reference(self, handle: AdapterHandle) -> None:
        """A sequence is queued with ``handle``; it references it until `unreference`."""
        use = self._uses.get(handle.id)
        if use is None:
            use = self._uses[handle.id] = AdapterUse(handle)
            self._referenced(handle)
        use.sequences += 1

    def unreference(self, handle: AdapterHandle) -> None:
        use = self._uses[handle.id]
        use.sequences -= 1
        self._maybe_release(use)

    def start(self, handle: AdapterHandle) -> int:
        """A sequence of ``handle`` is about to run; returns the GPU slot it runs in.

        :raises LoRAError: the adapter cannot be placed (only that sequence fails).
        """
        use = self._uses[handle.id]
        if not use.needs_slot:
            use.slot = self._place(handle)
        use.running += 1
        return use.slot

    def stop(self, handle: AdapterHandle) -> None:
        """A running sequence of ``handle`` stopped (finished or preempted)."""
        use = self._uses[handle.id]
        use.running -= 1
        self._maybe_end(use)

    # -- user pins ------------------------------------------------------------------------------

    def pin(self, handle: AdapterHandle) -> int:
        """Hold ``handle`` in a GPU slot until `unpin` (a reference the engine holds); returns its slot.

        :raises LoRAError: it cannot be placed; nothing changed.
        """
        use = self._uses.get(handle.id)
        if use is None:
            use = self._uses[handle.id] = AdapterUse(handle)
            self._referenced(handle)
        if not use.needs_slot:
            try:
                use.slot = self._place(handle)
            except BaseException:
                self._maybe_release(use)
                raise
        use.user_pins += 1
        return use.slot

    def unpin(self, handle: AdapterHandle) -> None:
        use = self._uses.get(handle.id)
        assert use is not None and use.user_pins > 0, f"{handle!r} is not pinned"
        use.user_pins -= 1
        self._maybe_end(use)
        self._maybe_release(use)

    def _maybe_end(self, use: AdapterUse) -> None:
        if use.slot is not None and not use.needs_slot:
            use.slot = None
            self._ended(use.handle)

    def _maybe_release(self, use: AdapterUse) -> None:
        assert use.sequences >= 0 and use.running >= 0 and use.user_pins >= 0, use
        if use.references == 0:
            del self._uses[use.handle.id]
            self._released(use.handle)

    # -- the tiers behind the counts (none here) ------------------------------------------------

    def _referenced(self, handle: AdapterHandle) -> None:
        """Its first reference appeared."""

    def _place(self, handle: AdapterHandle) -> int:
        """It needs a GPU slot now (a sequence starts, or a user pin); returns the slot."""
        return 0

    def _ended(self, handle: AdapterHandle) -> None:
        """It no longer needs its slot (which stays resident, evictable)."""

    def _released(self, handle: AdapterHandle) -> None:
        """Its last reference went."""

    def _has_room(self, handle: AdapterHandle) -> bool:
        """Whether it would find room on the GPU beside the handles in use (pooled by rank: a
        free slot is not always enough)."""
        return True

    def _fits_beside(self, handle: AdapterHandle, pinned: set[int]) -> bool:
        """Whether it would find room beside the user-pinned handles ``pinned`` alone."""
        return True

    def _is_placed(self, handle: AdapterHandle) -> bool:
        """Whether its weights sit in a GPU slot already."""
        return True
