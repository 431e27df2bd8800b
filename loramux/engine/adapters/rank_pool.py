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

`RowGroups` keeps the pools of a model's layers: every layer's pool has the same rows, and layers
that every write so far gave the same rows (all q/v projections, under q/v adapters) hold the same
table, so a group of them shares one `RankPool`. A write, a clear and a question of room then cost
a few Python steps per group, not per layer (an 8B model has 128 pooled layers, and the engine's
thread places adapters between steps); a write that gives a group's layers different rows splits
it, and groups whose tables are equal again merge.
"""

from __future__ import annotations

from bisect import bisect
from collections.abc import Collection, Sequence

import numpy as np

__all__ = ["RankPool", "RowGroups"]


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
            if len(self._free) == 1:  # a pool not fragmented: no search (the engine's thread asks per group)
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

    def copy(self) -> RankPool:
        """A pool with the same rows owned and free, apart from this one."""
        twin = RankPool(self.units, self.region)
        twin._free, twin._owned, twin._owned_units = list(self._free), dict(self._owned), self._owned_units
        return twin

    def table_key(self) -> tuple:
        """A key that pools holding the same table share (cheap: not the table itself)."""
        return self.free_units, len(self._owned), tuple(self._free[:1])

    def same_rows(self, other: RankPool) -> bool:
        """Whether ``other`` holds the same table (its free ranges follow from the owned ones)."""
        return self._owned == other._owned and self.region == other.region and self.units == other.units

    def check(self) -> None:
        """Assert the bookkeeping is whole: free and owned ranges apart, together every row once
        (tests call it; the hot path does not, it would walk every range)."""
        ranges = sorted([*self._owned.values(), *self._free])
        assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:])), f"ranges overlap: {ranges}"
        assert self._owned_units == sum(n for _, n in self._owned.values())
        if self.region is None:
            assert self._owned_units + sum(n for _, n in self._free) == self.units, "rows lost or gained"
            assert all(a + n < b for (a, n), (b, _) in zip(self._free, self._free[1:])), "free ranges not merged"


class RowGroups:
    """The rank pools of ``len(owners)`` layers, each of ``units`` rows (``region``: `RankPool`'s),
    one pool per group of layers every write gave the same rows (see the module docstring).

    :param owners: one per layer (its `LayerSlots`): each one's ``rows`` is kept pointing at its
        group's pool, so a layer reads its own table.
    """

    def __init__(self, owners: Sequence, units: int, region: int | None = None) -> None:
        self._owners = list(owners)
        self.units = units
        self._pools = [RankPool(units, region)]
        self._members = [np.arange(len(self._owners))]  # per group: its layers
        self._point(0)

    @property
    def pools(self) -> list[RankPool]:
        """The distinct pools, one per group."""
        return list(self._pools)

    def needs(self, rows: np.ndarray) -> list[tuple[RankPool, int]]:
        """Per group where ``rows`` (per layer) asks for any: its pool and the most rows a layer
        of it asks for (a group's layers hold one table, so that many fit in all of them or none)."""
        asked = ((pool, int(rows[members].max(initial=0))) for pool, members in zip(self._pools, self._members))
        return [(pool, n) for pool, n in asked if n]

    def fits(self, rows: np.ndarray) -> bool:
        """Whether every layer has ``rows[j]`` rows free now."""
        return all(pool.fits(n) for pool, n in self.needs(rows))

    def fits_keeping(self, rows: np.ndarray, keep: Collection[int]) -> bool:
        """Whether every layer would have ``rows[j]`` rows free if only the keys in ``keep`` held rows."""
        return all(pool.fits_keeping(n, keep) for pool, n in self.needs(rows))

    def short(self, rows: np.ndarray) -> list[RankPool]:
        """The pools without ``rows`` free now (of a layer asking for them)."""
        return [pool for pool, n in self.needs(rows) if not pool.fits(n)]

    def allocate(self, key: int, rows: np.ndarray) -> np.ndarray | None:
        """Give ``key`` (owning none) ``rows[j]`` rows in each layer j, one range per group;
        returns each layer's first row (0 where it takes none), or None when a group has no
        room (nothing is taken then)."""
        self._split(rows)
        start = np.zeros(len(self._owners), dtype=np.int64)
        taken = []
        for pool, members in zip(self._pools, self._members):
            n = int(rows[members[0]]) if len(members) else 0
            if not n:
                continue
            at = pool.allocate(key, n)
            if at is None:
                for other in taken:
                    other.free(key)
                self._merge()  # the groups split for it hold equal tables again
                return None
            taken.append(pool)
            start[members] = at
        return start

    def free(self, key: int) -> None:
        """Give ``key``'s rows back in every layer; groups whose tables are equal again merge."""
        held = [pool for pool in self._pools if key in pool]
        for pool in held:
            pool.free(key)
        if held and len(self._pools) > 1:
            self._merge()

    def _merge(self) -> None:
        """Merge the groups whose tables are equal (compared within a cheap signature's bucket:
        with per-layer ranks there may be a group per layer)."""
        buckets: dict[tuple, list[int]] = {}
        for g, pool in enumerate(self._pools):
            buckets.setdefault(pool.table_key(), []).append(g)
        gone: set[int] = set()
        for same in buckets.values():
            for i, g in enumerate(same):
                if g in gone:
                    continue
                twins = [h for h in same[i + 1:] if h not in gone and self._pools[g].same_rows(self._pools[h])]
                if not twins:
                    continue
                self._members[g] = np.concatenate([self._members[g], *(self._members[h] for h in twins)])
                gone.update(twins)
                self._point(g)
        for h in sorted(gone, reverse=True):
            del self._pools[h], self._members[h]

    def _split(self, rows: np.ndarray) -> None:
        """Split every group whose layers ``rows`` gives different counts: each count's layers
        get a copy of the group's pool."""
        for g in range(len(self._pools)):  # the groups split off here are whole already
            members = self._members[g]
            asked = rows[members]
            if not len(asked) or asked.min() == asked.max():
                continue
            counts = np.unique(asked)
            self._members[g] = members[asked == counts[0]]
            for n in counts[1:]:
                self._pools.append(self._pools[g].copy())
                self._members.append(members[asked == n])
                self._point(len(self._pools) - 1)

    def _point(self, g: int) -> None:
        pool = self._pools[g]
        for j in self._members[g].tolist():
            # into the instance's dict: a module's __setattr__ type-checks every value (a split
            # points a hundred layers between two steps)
            self._owners[j].__dict__["rows"] = pool
