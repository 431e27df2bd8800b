"""The CPU tier: a thread-safe LRU of loaded adapters, keyed by handle id, bounded in count and bytes.

Modelled on nano-vllm's block manager: a plain class, reference counts (pins) for what running
requests use, and eviction only of what nobody pins. It knows adapters by their
:class:`~loramux.registry.AdapterHandle` id only; names, loading and single-flight live in the
:class:`~loramux.registry.Registry` above it. The engine pins exactly the handles its scheduler
references, so an adapter in use never leaves host memory.

A *retired* handle (its name was rebound by a reload, or unbound by an unload) stays while
pinned and leaves the tier at its last unpin: requests already running finish on it, and nothing
new can reach it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from loramux.errors import CacheBusyError, CacheFullError, LoRAError
from loramux.registry.adapter import LoRAAdapter
from loramux.registry.handle import AdapterHandle

__all__ = ["CPUAdapterCache", "CacheStats"]


@dataclass
class CacheStats:
    """Counters for metrics: lookups that hit or missed, loads done, adapters evicted."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0


class CPUAdapterCache:
    """Loaded adapters in host memory by handle id, least recently used first out.

    :param max_loras: at most this many adapters are kept (None: no count bound, ``max_bytes`` alone).
    :param max_bytes: at most this many bytes of weights are kept (None: no byte bound; the
        registry always passes one, see :attr:`LoRAConfig.max_cpu_lora_bytes`).
    :param on_evict: called with the handle of each adapter that leaves the tier to make room or
        at its last unpin after retiring (outside the lock).
    """

    def __init__(
        self,
        max_loras: int | None,
        max_bytes: int | None = None,
        *,
        on_evict: Callable[[AdapterHandle], None] | None = None,
    ) -> None:
        if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)
                                      or max_loras < 1):
            raise ValueError(f"CPUAdapterCache max_loras: got {max_loras!r}; allowed: an int >= 1 or None")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise ValueError(f"CPUAdapterCache max_bytes: got {max_bytes!r}; allowed: an int >= 1 or None")
        self.max_loras = max_loras
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # oldest first
        self._pins: dict[int, int] = {}
        self._retired: set[int] = set()
        self._nbytes = 0

    # -- lookups -------------------------------------------------------------------------------

    def __contains__(self, handle_id: int) -> bool:
        with self._lock:
            return handle_id in self._adapters

    def __len__(self) -> int:
        with self._lock:
            return len(self._adapters)

    def handle_ids(self) -> list[int]:
        """Resident handle ids, least recently used first."""
        with self._lock:
            return list(self._adapters)

    def names(self) -> list[str]:
        """Names of the resident adapters, least recently used first (a name shows twice while
        an old handle of it still runs beside the new one)."""
        with self._lock:
            return [adapter.name for adapter in self._adapters.values()]

    @property
    def nbytes(self) -> int:
        """Bytes of weights resident now."""
        with self._lock:
            return self._nbytes

    def get(self, handle_id: int, *, pin: bool = False) -> LoRAAdapter | None:
        """The adapter if resident (marking it most recently used), else None; counts a hit or miss.

        :param pin: also pin it, atomically (so it cannot be evicted between lookup and pin).
        """
        with self._lock:
            adapter = self._adapters.get(handle_id)
            if adapter is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._adapters.move_to_end(handle_id)
            if pin:
                self._pins[handle_id] = self._pins.get(handle_id, 0) + 1
            return adapter

    def peek(self, handle_id: int) -> LoRAAdapter | None:
        """The adapter if resident, else None; neither counted nor moved in the eviction order."""
        with self._lock:
            return self._adapters.get(handle_id)

    def record_miss(self) -> None:
        """Count a lookup that found nothing without asking by id (a name not loaded yet)."""
        with self._lock:
            self.stats.misses += 1

    def record_load_failure(self) -> None:
        """Count a load meant for this tier that failed (the registry loads; the tier counts)."""
        with self._lock:
            self.stats.load_failures += 1

    # -- insertion -----------------------------------------------------------------------------

    def put(self, adapter: LoRAAdapter, *, pin: bool = False) -> list[AdapterHandle]:
        """Insert ``adapter`` (which must carry its handle) as most recently used; evict the least
        recently used unpinned adapters until the tier is within both budgets.

        :param pin: also pin it, atomically (it cannot be evicted in between).
        :returns: the handles evicted (``on_evict`` was called for each).
        :raises CacheFullError: it cannot fit beside the pinned adapters, or is larger than the
            whole byte budget; nothing changed.
        """
        handle = adapter.handle
        if handle is None:
            raise ValueError(f"adapter {adapter.name!r} has no handle; the Registry issues them")
        with self._lock:
            self._check_fits(handle)
            if handle.id not in self._adapters:
                self._nbytes += handle.nbytes
                self.stats.loads += 1
            self._adapters[handle.id] = adapter
            self._adapters.move_to_end(handle.id)
            if pin:
                self._pins[handle.id] = self._pins.get(handle.id, 0) + 1
            evicted = []
            while self._over_budget():
                victim = next(i for i in self._adapters if not self._pins.get(i))
                evicted.append(self._drop(victim))
            self.stats.evictions += len(evicted)
        self._notify(evicted)
        return evicted

    def _over_budget(self) -> bool:
        too_many = self.max_loras is not None and len(self._adapters) > self.max_loras
        return too_many or (self.max_bytes is not None and self._nbytes > self.max_bytes)

    def _check_fits(self, handle: AdapterHandle) -> None:
        """Raise before anything changes if ``handle`` cannot fit beside the pinned adapters."""
        if self.max_bytes is not None and handle.nbytes > self.max_bytes:
            raise CacheFullError(
                f"its weights take {handle.nbytes:,} bytes, more than the CPU tier's whole budget "
                f"of {self.max_bytes:,} bytes.",
                adapter=handle.name,
                fix="Raise the CPU tier's byte budget (max_cpu_lora_bytes, --max-cpu-lora-bytes).",
            )
        kept = [i for i in self._adapters if self._pins.get(i) and i != handle.id]
        kept_bytes = sum(self._adapters[i].handle.nbytes for i in kept)
        too_many = self.max_loras is not None and len(kept) + 1 > self.max_loras
        too_big = self.max_bytes is not None and kept_bytes + handle.nbytes > self.max_bytes
        if too_many or too_big:
            count = f"{self.max_loras} adapters, " if self.max_loras is not None else ""
            raise CacheBusyError(
                f"the CPU tier is full of adapters in use ({len(kept)} pinned, {kept_bytes:,} "
                f"bytes; limits {count}{self.max_bytes or 0:,} bytes), so there "
                "is no room for it now.",
                adapter=handle.name,
                fix="Retry when running requests finish, or raise max_cpu_loras "
                "(--max-cpu-loras) or max_cpu_lora_bytes (--max-cpu-lora-bytes).",
            )

    def _drop(self, handle_id: int) -> AdapterHandle:
        adapter = self._adapters.pop(handle_id)
        self._nbytes -= adapter.handle.nbytes
        self._pins.pop(handle_id, None)
        self._retired.discard(handle_id)
        return adapter.handle

    def _notify(self, handles: list[AdapterHandle]) -> None:
        if self.on_evict is not None:
            for handle in handles:
                self.on_evict(handle)

    # -- pins, retirement and removal ----------------------------------------------------------

    def pin(self, handle_id: int) -> None:
        """Keep ``handle_id`` resident until as many :meth:`unpin` calls (a reference count).

        :raises LoRAError: it is not resident.
        """
        with self._lock:
            adapter = self._adapters.get(handle_id)
            if adapter is None:
                raise LoRAError(f"cannot pin adapter handle {handle_id}: it is not in the CPU tier.")
            self._pins[handle_id] = self._pins.get(handle_id, 0) + 1

    def unpin(self, handle_id: int) -> None:
        """Release one pin; at the last one a retired handle leaves the tier.

        :raises LoRAError: it is not pinned.
        """
        with self._lock:
            count = self._pins.get(handle_id, 0)
            if count < 1:
                raise LoRAError(f"cannot unpin adapter handle {handle_id}: it is not pinned.")
            if count > 1:
                self._pins[handle_id] = count - 1
                return
            del self._pins[handle_id]
            gone = [self._drop(handle_id)] if handle_id in self._retired else []
        self._notify(gone)

    @property
    def usage(self) -> float:
        """The tier's pressure, 0 to 1: the fuller of its bytes and (when bounded) its count."""
        with self._lock:
            by_bytes = self._nbytes / self.max_bytes if self.max_bytes else 0.0
            by_count = len(self._adapters) / self.max_loras if self.max_loras else 0.0
            return max(by_bytes, by_count)

    def num_pinned(self) -> int:
        """How many resident adapters are pinned now."""
        with self._lock:
            return len(self._pins)

    def is_pinned(self, handle_id: int) -> bool:
        with self._lock:
            return bool(self._pins.get(handle_id))

    def pin_count(self, handle_id: int) -> int:
        with self._lock:
            return self._pins.get(handle_id, 0)

    def retire(self, handle_id: int) -> bool:
        """Nothing new will ask for ``handle_id``: drop it now if unpinned, else at its last unpin.

        :returns: whether it left the tier now.
        """
        with self._lock:
            if handle_id not in self._adapters:
                return False
            if self._pins.get(handle_id):
                self._retired.add(handle_id)
                return False
            gone = [self._drop(handle_id)]
        self._notify(gone)
        return True

    def remove(self, handle_id: int) -> bool:
        """Drop ``handle_id`` and its pins at once; returns whether it was resident."""
        with self._lock:
            if handle_id not in self._adapters:
                return False
            self._drop(handle_id)
            return True
