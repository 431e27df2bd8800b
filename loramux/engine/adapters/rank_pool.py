"""`RankPool`: which rows of a layer's adapter pool each GPU slot owns.

A pooled LoRA layer keeps every resident adapter's weights in one pool of ``units`` rank rows
(`loramux.engine.layers.base`): an adapter of rank r on that layer owns r consecutive rows, one
of rank 8 an eighth of what one of rank 64 takes, and a layer an adapter does not touch gives
it none (S-LoRA's unified paging, with a row as the page). This table is the host-side
bookkeeping of one pool: free row ranges, best fit, neighbours merged on free. It holds no
tensors and is not thread-safe on its own (the model manager serialises calls).

Eviction is the model manager's: it asks :meth:`fits` before a write and frees the least
recently used adapters until it does; :meth:`fits_keeping` answers whether freeing every
adapter not in use would make room, without freeing anything.

Shared rows fragment: adapters of mixed ranks leave free runs too short for a large one until
the adapters between them leave. A pool with ``region`` set instead gives key k the fixed rows
``[k * region, (k + 1) * region)``: no sharing and no fragmentation, every key able to take
``region`` rows (the model manager's default pool, sized ``max_loras`` regions of the largest
rank, as slots were before pooling).
"""

from __future__ import annotations

from bisect import bisect

__all__ = ["RankPool"]


class RankPool:
    """``units`` rank rows; each key (a slot) owns at most one range of them.

    :param units: rows in the pool.
    :param region: give key k the fixed rows from ``k * region`` instead (keys below
        ``units // region``).
    """

    def __init__(self, units: int, region: int | None = None) -> None:
        assert units >= 0, f"units must be >= 0, got {units}"
        assert region is None or region > 0, f"region must be > 0, got {region}"
        self.units = units
        self.region = region
        # (start, size) by start, merged; with regions each key's rows are fixed: no free list
        self._free: list[tuple[int, int]] = [(0, units)] if units and region is None else []
        self._owned: dict[int, tuple[int, int]] = {}  # key -> (start, size)
        self._owned_units = 0

    def __contains__(self, key: int) -> bool:
        return key in self._owned

    def start_of(self, key: int) -> int | None:
        block = self._owned.get(key)
        return None if block is None else block[0]

    @property
    def free_units(self) -> int:
        return self.units - self._owned_units

    def fits(self, size: int) -> bool:
        """Whether a range of ``size`` rows is free now (with regions: whether a region holds
        them; a key without rows has its region free)."""
        if self.region is not None:
            return size <= self.region
        return size == 0 or any(free >= size for _, free in self._free)

    def fits_keeping(self, size: int, keep) -> bool:
        """Whether a range of ``size`` rows would be free if only the keys in ``keep`` held rows."""
        if size == 0:
            return True
        if self.region is not None:
            return size <= self.region
        at = 0
        for start, owned in sorted(self._owned[key] for key in keep if key in self._owned):
            if start - at >= size:
                return True
            at = start + owned
        return self.units - at >= size

    def allocate(self, key: int, size: int) -> int | None:
        """Give ``key`` ``size`` rows (the smallest free range that holds them); returns the first
        row, or None when no free range is large enough (nothing changes). ``size`` 0 owns nothing."""
        assert key not in self._owned, f"key {key} owns rows already; free them first"
        if size == 0:
            return None
        if self.region is not None:
            if size > self.region:
                return None
            start = key * self.region
            assert start + self.region <= self.units, f"key {key} has no region in {self.units} rows"
        else:
            if len(self._free) == 1:  # a pool not fragmented: no search (the engine's thread asks per layer)
                best = 0 if self._free[0][1] >= size else None
            else:
                best = min((i for i, (_, free) in enumerate(self._free) if free >= size),
                           key=lambda i: self._free[i][1], default=None)
            if best is None:
                return None
            start, free = self._free[best]
            if free > size:  # the rest stays where it was in the start order
                self._free[best] = (start + size, free - size)
            else:
                del self._free[best]
        self._owned[key] = (start, size)
        self._owned_units += size
        return start

    def free(self, key: int) -> None:
        """Give ``key``'s rows back (a no-op when it owns none), merged with free neighbours."""
        block = self._owned.pop(key, None)
        if block is None:
            return
        start, size = block
        self._owned_units -= size
        if self.region is not None:
            return
        # merge with the free neighbours only: every free range is apart from the others already
        i = bisect(self._free, block)
        if i < len(self._free) and self._free[i][0] == start + size:  # the range after it
            size += self._free.pop(i)[1]
        if i and sum(self._free[i - 1]) == start:  # the range before it
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + size)
        else:
            self._free.insert(i, (start, size))

    def check(self) -> None:
        """Assert the bookkeeping is whole: free and owned ranges apart, together every row once
        (tests call it; the hot path does not, it would walk every range)."""
        ranges = sorted([*self._owned.values(), *self._free])
        assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:])), f"ranges overlap: {ranges}"
        assert self._owned_units == sum(n for _, n in self._owned.values())
        if self.region is None:
            assert self._owned_units + sum(n for _, n in self._free) == self.units, "rows lost or gained"
            assert all(a + n < b for (a, n), (b, _) in zip(self._free, self._free[1:])), "free ranges not merged"
