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

from bisect import insort

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
        self._free: list[tuple[int, int]] = [(0, units)] if units else []  # (start, size), by start
        self._owned: dict[int, tuple[int, int]] = {}  # key -> (start, size)

    def __contains__(self, key: int) -> bool:
        return key in self._owned

    def start_of(self, key: int) -> int | None:
        block = self._owned.get(key)
        return None if block is None else block[0]

    @property
    def free_units(self) -> int:
        return sum(size for _, size in self._free)

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
            self._free = _without(self._free, start, size)
            self._owned[key] = (start, size)
            return start
        best = min((i for i, (_, free) in enumerate(self._free) if free >= size),
                   key=lambda i: self._free[i][1], default=None)
        if best is None:
            return None
        start, free = self._free.pop(best)
        if free > size:
            insort(self._free, (start + size, free - size))
        self._owned[key] = (start, size)
        return start

    def free(self, key: int) -> None:
        """Give ``key``'s rows back (a no-op when it owns none), merged with free neighbours."""
        block = self._owned.pop(key, None)
        if block is None:
            return
        insort(self._free, block)
        merged: list[tuple[int, int]] = []
        for start, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged
        assert sum(s for _, s in self._free) + sum(s for _, s in self._owned.values()) == self.units

    def fits_instead(self, key: int, size: int) -> bool:
        """Whether ``key`` could hold ``size`` rows once its own rows are freed (a rewrite)."""
        return self.fits_keeping(size, [k for k in self._owned if k != key])


def _without(free: list[tuple[int, int]], start: int, size: int) -> list[tuple[int, int]]:
    """``free`` ranges less ``[start, start + size)``, which one of them holds."""
    out = []
    for at, length in free:
        if at <= start and start + size <= at + length:
            out += [r for r in ((at, start - at), (start + size, at + length - start - size)) if r[1]]
        else:
            out.append((at, length))
    return out
