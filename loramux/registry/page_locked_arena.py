"""`PageLockedArena`: the CPU tier's page-locked memory, allocated once when the engine starts and
carved into one piece per adapter by the loader threads, so that nothing is page-locked while
serving (why: `loramux.registry.host_memory`).

    arena = PageLockedArena(8 << 30)              # at engine start: page-locked segments (cudaHostAlloc)
    buffer = arena.allocate(nbytes)           # a loader thread: a piece, no CUDA call
    ...                                       # the engine copies from it with non_blocking=True
    arena.fence(event)                        # ... then says when those copies will have run

**When a piece comes back.** A piece is a numpy view of a segment, and the tensors over it hold
that view (``torch.from_numpy``), so it is freed only when nothing references it any more: not the
CPU tier, not a request, not a view, not a storage. A reference proves no *host* code uses it; a
copy from it may still be queued on a CUDA stream, though. So whoever copies asynchronously from
arena memory calls :meth:`PageLockedArena.fence` with a fence (a ``torch.cuda.Event`` recorded after
the copies) *while still holding the tensors it copied from*; a piece released after that call is
reused only once every fence outstanding when it was released has completed. Fences are not tied
to pieces: a fence covers every copy queued before it, so the engine records one per slot write
without telling which buffers it read, and a piece waits at most for the copies in flight.

**When there is no room** (the arena is full, or no free extent is large enough) a load gets
pageable memory (counted in :attr:`ArenaStats.fallbacks`): slower copies, never a page-locked
allocation while serving.

**Reserved beside the start.** Page-locking 8 GiB takes seconds, so the engine makes its arena
with ``in_background=True``: a thread of its own page-locks it while the engine compiles and
captures; `PageLockedArena.wait` joins it (the engine calls it before it captures any graph, since a
``cudaHostAlloc`` on another thread would break a capture), and an allocation before then waits
for it. If the host cannot lock that much, the arena stays empty and every load takes pageable
memory (a warning says so).

The arena is split into at most `MAX_SEGMENTS` segments whose sizes are powers of two: PyTorch's
host allocator rounds every page-locked allocation up to one, so a segment of any other size would
lock memory nobody can use. ``pinned=False`` makes it of pageable memory: the same bookkeeping,
for CPU tests.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

__all__ = ["ArenaStats", "Fence", "MAX_SEGMENTS", "PIECE_ALIGNMENT", "PageLockedArena", "segment_sizes"]

#: Pieces start on this boundary (any dtype's alignment, and a DMA-friendly one).
PIECE_ALIGNMENT = 512
#: Segments the arena is split into (the largest powers of two in its size).
MAX_SEGMENTS = 4
#: Outstanding fences kept before the completed ones are dropped.
_FENCES_KEPT = 32


class Fence(Protocol):
    """A point in a CUDA stream: ``query()`` is True once everything queued before it has run
    (``torch.cuda.Event`` is one)."""

    def query(self) -> bool: ...


@dataclass(frozen=True)
class ArenaStats:
    """A snapshot of the arena, for metrics.

    :ivar capacity_bytes: bytes of the arena (its segments).
    :ivar in_use_bytes: bytes in pieces not freed yet (referenced, or waiting on a fence).
    :ivar pieces: pieces handed out and not freed yet.
    :ivar allocations: pieces handed out since the start.
    :ivar fallbacks: allocations that found no room and got pageable memory instead.
    :ivar fallback_bytes: bytes of those.
    """

    capacity_bytes: int
    in_use_bytes: int
    pieces: int
    allocations: int
    fallbacks: int
    fallback_bytes: int


def segment_sizes(nbytes: int) -> list[int]:
    """The powers of two, largest first and at most `MAX_SEGMENTS`, that sum to most of ``nbytes``
    (10 GB: 8 GiB + 1 GiB + 256 MiB + 64 MiB)."""
    bits = [1 << i for i in range(nbytes.bit_length() - 1, -1, -1) if nbytes >> i & 1]
    return [size for size in bits[:MAX_SEGMENTS] if size >= PIECE_ALIGNMENT]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PIECE_ALIGNMENT) * PIECE_ALIGNMENT


@dataclass
class _Piece:
    segment: int
    offset: int
    size: int  # reserved: the request rounded up to PIECE_ALIGNMENT
    view: weakref.ref  # to the numpy view its tensors hold; its callback frees the piece
    fences: tuple[Fence, ...] = ()  # set when released: the copies that may still read it


class PageLockedArena:
    """Page-locked host memory of ``nbytes`` (rounded down to `segment_sizes`), allocated now, or
    on a thread of its own with ``in_background`` (see the module docstring).

    Thread-safe: loader threads allocate, the engine's thread fences, any thread releases.

    :param nbytes: the arena's size; at least `PIECE_ALIGNMENT`.
    :param pinned: page-locked memory (needs CUDA); False: pageable, for tests.
    :raises ValueError: ``nbytes`` is too small.
    :raises RuntimeError: the page-locked memory cannot be allocated (now; in the background the
        arena stays empty instead).
    """

    def __init__(self, nbytes: int, *, pinned: bool = True, in_background: bool = False) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < PIECE_ALIGNMENT:
            raise ValueError(f"PageLockedArena nbytes: got {nbytes!r}; allowed: an int >= {PIECE_ALIGNMENT}")
        self._pinned = pinned
        self.reserve_seconds = 0.0  # page-locking took (on its thread, in the background)
        self.waited_seconds = 0.0  # `wait` waited for it
        self._segments: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._reserving: threading.Thread | None = None
        if in_background:
            self._reserving = threading.Thread(target=self._reserve, args=(nbytes, True), name="loramux-pin-arena",
                                               daemon=True)
            self._reserving.start()
        else:
            self._reserve(nbytes, False)

    def _reserve(self, nbytes: int, in_background: bool) -> None:
        started = time.perf_counter()
        try:
            self._segments = [torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
                              for size in segment_sizes(nbytes)]
        except RuntimeError as error:
            if not in_background:
                raise
            self._pinned, self._segments = False, []  # every load takes pageable memory: serve, slower
            logger.warning("could not page-lock %d bytes for the adapters in host memory (%s); they stay in "
                           "pageable memory. Lower max_pinned_lora_bytes (--max-pinned-lora-bytes).", nbytes, error)
        except BaseException as error:  # raised by `wait`, on the engine's thread
            self._error = error
        self._arrays = [segment.numpy() for segment in self._segments]
        self.capacity = sum(segment.numel() for segment in self._segments)
        # per segment, its free extents: offsets (sorted) and their sizes
        self._free_offsets: list[list[int]] = [[0] for _ in self._segments]
        self._free_sizes: list[list[int]] = [[segment.numel()] for segment in self._segments]
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._live: dict[int, _Piece] = {}  # referenced pieces, by key
        self._released: deque[int] = deque()  # keys of pieces nothing references any more
        self._waiting: list[_Piece] = []  # released pieces whose fences have not all completed
        self._fences: list[Fence] = []  # fences that had not completed when last looked at
        self._free_bytes = self.capacity
        self._allocations = self._fallbacks = self._fallback_bytes = 0
        self.reserve_seconds = time.perf_counter() - started
        if in_background and self._segments:
            logger.info("adapters in host memory: %r, page-locked in %.1f s", self, self.reserve_seconds)

    @property
    def pinned(self) -> bool:
        """Whether its pieces are page-locked (False: pageable, or the host refused to lock it)."""
        self.wait()
        return self._pinned

    def wait(self) -> PageLockedArena:
        """Wait for the page-locking thread (once; later calls return at once).

        :raises: what page-locking raised (other than the host's refusal, which leaves it empty).
        """
        thread = self._reserving
        if thread is not None:
            started = time.perf_counter()
            thread.join()
            self._reserving = None
            self.waited_seconds = time.perf_counter() - started
        if self._error is not None:
            raise self._error
        return self

    # -- loader threads -------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` over a free piece of the arena, or over pageable memory when
        no free piece is large enough (a fallback: counted, never a page-locked allocation)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        self.wait()
        size = _aligned(nbytes)
        with self._lock:
            self._reclaim()
            place = self._take(size)
            if place is None:
                self._fallbacks += 1
                self._fallback_bytes += nbytes
            else:
                self._allocations += 1
                segment, offset = place
                view = self._arrays[segment][offset : offset + nbytes]
                key = next(self._keys)
                released = self._released  # the callback must not keep the arena's lock: append only
                self._live[key] = _Piece(segment, offset, size, weakref.ref(view, lambda _, k=key: released.append(k)))
        if place is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        return torch.from_numpy(view)  # holds `view`: the piece is freed when the last tensor over it goes

    def _take(self, size: int) -> tuple[int, int] | None:
        """The smallest free extent of at least ``size`` bytes, shrunk by ``size`` (best fit keeps
        the large extents for large adapters)."""
        best = None
        for segment, sizes in enumerate(self._free_sizes):
            for index, free in enumerate(sizes):
                if free >= size and (best is None or free < best[2]):
                    best = (segment, index, free)
        if best is None:
            return None
        segment, index, free = best
        offset = self._free_offsets[segment][index]
        if free == size:
            del self._free_offsets[segment][index], self._free_sizes[segment][index]
        else:
            self._free_offsets[segment][index] += size
            self._free_sizes[segment][index] -= size
        self._free_bytes -= size
        return segment, offset

    # -- the engine's thread --------------------------------------------------------------------

    def fence(self, fence: Fence) -> None:
        """Asynchronous copies queued so far from arena memory have run once ``fence.query()`` is
        True: no piece released from now on is reused before then. Call it after queueing the
        copies and before dropping the tensors copied from."""
        if self._reserving is not None:  # nothing allocated yet: nothing to copy from
            return
        with self._lock:
            if len(self._fences) >= _FENCES_KEPT:
                self._fences = [f for f in self._fences if not f.query()]
            self._fences.append(fence)

    # -- freeing --------------------------------------------------------------------------------

    def _reclaim(self) -> None:
        """Under the lock: pieces released since the last call wait on the fences outstanding now
        (a superset of those outstanding when they were released); free those whose fences all
        completed."""
        while self._released:
            piece = self._live.pop(self._released.popleft())
            piece.fences = tuple(self._fences)
            self._waiting.append(piece)
        if not self._waiting:
            return
        self._fences = [f for f in self._fences if not f.query()]
        outstanding = {id(f) for f in self._fences}  # the pieces hold their fences: ids stay unique
        waiting = []
        for piece in self._waiting:
            if any(id(f) in outstanding for f in piece.fences):
                waiting.append(piece)
            else:
                self._give_back(piece)
        self._waiting = waiting

    def _give_back(self, piece: _Piece) -> None:
        """Return ``piece``'s extent to its segment's free list, merged with its free neighbours."""
        offsets, sizes = self._free_offsets[piece.segment], self._free_sizes[piece.segment]
        index = bisect.bisect(offsets, piece.offset)
        start, size = piece.offset, piece.size
        if index < len(offsets) and offsets[index] == start + size:  # the next extent is free
            size += sizes[index]
            del offsets[index], sizes[index]
        if index > 0 and offsets[index - 1] + sizes[index - 1] == start:  # so is the previous one
            sizes[index - 1] += size
        else:
            offsets.insert(index, start)
            sizes.insert(index, size)
        self._free_bytes += piece.size

    # -- reading --------------------------------------------------------------------------------

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in the arena."""
        self.wait()
        pointer = tensor.untyped_storage().data_ptr()
        return any(0 <= pointer - segment.data_ptr() < segment.numel() for segment in self._segments)

    @property
    def stats(self) -> ArenaStats:
        self.wait()
        with self._lock:
            self._reclaim()
            return ArenaStats(self.capacity, self.capacity - self._free_bytes, len(self._live) + len(self._waiting),
                              self._allocations, self._fallbacks, self._fallback_bytes)

    def __repr__(self) -> str:
        kind = "page-locked" if self._pinned else "pageable"
        return f"PageLockedArena({self.capacity:,} bytes {kind} in {len(self._segments)} segment(s))"

