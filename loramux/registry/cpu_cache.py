"""The CPU tier: a thread-safe, bounded LRU of loaded adapters with single-flight loading.

Modelled on nano-vllm's block manager: a plain class, reference counts (pins) for what running
requests use, and eviction only of what nobody pins. Loads run outside the lock, so a slow load
never blocks hits on other adapters; concurrent requests for the same missing adapter share one
load (single-flight) and all see its result or its error.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from loramux.errors import CacheFullError, LoRAError
from loramux.registry.adapter import LoRAAdapter

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
    """Loaded adapters in host memory, least recently used first out.

    :param max_loras: at most this many adapters are kept.
    :param max_bytes: optional budget for the adapters' weights together.
    :param pin_memory: keep weights in page-locked memory (default: when CUDA is available), so
        copies into GPU slots run asynchronously.
    :param on_evict: called with the name of each evicted adapter (outside the lock).
    """

    def __init__(
        self,
        max_loras: int,
        max_bytes: int | None = None,
        *,
        pin_memory: bool | None = None,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.max_bytes = max_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.on_evict = on_evict
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # oldest first
        self._pins: dict[str, int] = {}
        self._loading: dict[str, Future[LoRAAdapter]] = {}

    # -- lookups -------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def __len__(self) -> int:
        with self._lock:
            return len(self._adapters)

    def names(self) -> list[str]:
        """Resident adapters, least recently used first."""
        with self._lock:
            return list(self._adapters)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(adapter.nbytes for adapter in self._adapters.values())

    def get(self, name: str) -> LoRAAdapter | None:
        """The adapter if resident (marking it most recently used), else None."""
        with self._lock:
            return self._touch(name)

    def _touch(self, name: str) -> LoRAAdapter | None:
        adapter = self._adapters.get(name)
        if adapter is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self._adapters.move_to_end(name)
        return adapter

    # -- loading -------------------------------------------------------------------------------

    def get_or_load(
        self, name: str, load: Callable[[], LoRAAdapter], *, pin: bool = False
    ) -> LoRAAdapter:
        """The resident adapter ``name``, or ``load()`` it once however many threads ask.

        :param load: builds the adapter; its exception reaches every waiter, and the cache is
            left exactly as it was.
        :param pin: also pin the adapter (atomically, so it cannot be evicted in between).
        :raises CacheFullError: every resident adapter is pinned, so there is no room.
        """
        with self._lock:
            adapter = self._touch(name)
            if adapter is not None:
                if pin:
                    self._pins[name] = self._pins.get(name, 0) + 1
                return adapter
            future = self._loading.get(name)
            leader = future is None
            if leader:
                future = self._loading[name] = Future()
        if not leader:
            adapter = future.result()  # raises the leader's error
            if pin:
                self.pin(name)
            return adapter
        try:
            adapter = load()
            if self.pin_memory:
                adapter = adapter.pin_memory()
            evicted = self._insert(name, adapter, pin=pin)
        except BaseException as error:
            with self._lock:
                self.stats.load_failures += 1
                del self._loading[name]
            future.set_exception(error)
            raise
        with self._lock:
            del self._loading[name]
        future.set_result(adapter)
        self._notify_evicted(evicted)
        return adapter

    def put(self, name: str, adapter: LoRAAdapter, *, pin: bool = False) -> None:
        """Insert or replace ``name`` (an in-place reload keeps its pins)."""
        if self.pin_memory:
            adapter = adapter.pin_memory()
        self._notify_evicted(self._insert(name, adapter, pin=pin))

    def _insert(self, name: str, adapter: LoRAAdapter, *, pin: bool) -> list[str]:
        with self._lock:
            self._check_fits(name, adapter)
            self._adapters[name] = adapter
            self._adapters.move_to_end(name)
            self.stats.loads += 1
            if pin:
                self._pins[name] = self._pins.get(name, 0) + 1
            evicted = []
            while self._over_budget():
                victim = next(n for n in self._adapters if not self._pins.get(n))
                del self._adapters[victim]
                evicted.append(victim)
            self.stats.evictions += len(evicted)
            return evicted

    def _over_budget(self) -> bool:
        too_many = len(self._adapters) > self.max_loras
        too_big = self.max_bytes is not None and (
            sum(adapter.nbytes for adapter in self._adapters.values()) > self.max_bytes
        )
        return too_many or too_big

    def _check_fits(self, name: str, adapter: LoRAAdapter) -> None:
        """Raise before anything changes if ``adapter`` cannot fit beside the pinned ones."""
        if self.max_bytes is not None and adapter.nbytes > self.max_bytes:
            raise CacheFullError(
                f"its weights take {adapter.nbytes} bytes, more than the CPU tier's whole budget "
                f"of {self.max_bytes} bytes.",
                adapter=name,
                fix="Raise the CPU tier's byte budget (max_cpu_bytes).",
            )
        kept = [n for n in self._adapters if self._pins.get(n) and n != name]
        kept_bytes = sum(self._adapters[n].nbytes for n in kept)
        if len(kept) + 1 > self.max_loras or (
            self.max_bytes is not None and kept_bytes + adapter.nbytes > self.max_bytes
        ):
            raise CacheFullError(
                f"the CPU tier is full of adapters in use ({len(kept)} pinned, "
                f"{kept_bytes} bytes), so there is no room for it now.",
                adapter=name,
                fix="Retry when running requests finish, or raise max_cpu_loras.",
            )

    def _notify_evicted(self, names: list[str]) -> None:
        if self.on_evict is not None:
            for name in names:
                self.on_evict(name)

    # -- pins and removal ----------------------------------------------------------------------

    def pin(self, name: str) -> None:
        """Keep ``name`` resident until as many ``unpin`` calls; pins nest (a reference count)."""
        with self._lock:
            if name not in self._adapters:
                raise LoRAError("cannot pin an adapter that is not loaded.", adapter=name)
            self._pins[name] = self._pins.get(name, 0) + 1

    def unpin(self, name: str) -> None:
        """Release one pin of ``name``; unknown or unpinned names are an error."""
        with self._lock:
            count = self._pins.get(name, 0)
            if count < 1:
                raise LoRAError("cannot unpin an adapter that is not pinned.", adapter=name)
            if count == 1:
                del self._pins[name]
            else:
                self._pins[name] = count - 1

    def is_pinned(self, name: str) -> bool:
        with self._lock:
            return bool(self._pins.get(name))

    def remove(self, name: str) -> bool:
        """Drop ``name`` (and its pins) from the tier; returns whether it was resident."""
        with self._lock:
            self._pins.pop(name, None)
            return self._adapters.pop(name, None) is not None
