"""Where a load puts an adapter's weights in host memory: pageable, page-locked per load, or a piece
of the engine's `~loramux.registry.page_locked_arena.PageLockedArena`.

A load asks its `HostMemory` for one uint8 buffer per adapter (``allocate(nbytes)``): the weights
file is read straight into it, or a cast packs into it. Page-locked memory lets the copy into a
GPU slot run asynchronously, but allocating it (``cudaHostAlloc``, which
``torch.empty(..., pin_memory=True)`` calls for any size PyTorch's host cache holds no block of)
takes the CUDA driver's lock: every CUDA call of the engine's thread waits behind it, so loads
pinning their own buffers make the engine's steps stall for as long as the pinning takes. So the
engine never pins per load: it reserves an arena at start and loads carve from it.
"""

from __future__ import annotations

import traceback
from typing import Protocol, runtime_checkable

import torch

__all__ = ["PAGEABLE", "PINNED_EACH_LOAD", "HostMemory", "PageableMemory", "PinnedEachLoad", "release_frames"]


@runtime_checkable
class HostMemory(Protocol):
    """An allocator of host buffers for adapter weights."""

    @property
    def pinned(self) -> bool:
        """Whether the buffers it hands out are page-locked (copies from them run asynchronously)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes``, contents undefined, alive as long as any view of it."""


class PageableMemory:
    """Ordinary host memory (``torch.empty``); a copy from it into a GPU slot is staged by the driver."""

    pinned = False

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class PinnedEachLoad:
    """Page-locked memory allocated for each load (a ``cudaHostAlloc`` when PyTorch's host cache has
    no block of the size): for a registry used on its own. The engine serves from a `PageLockedArena`,
    which allocates only at start."""

    pinned = True

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


PAGEABLE = PageableMemory()
PINNED_EACH_LOAD = PinnedEachLoad()


def release_frames(error: BaseException) -> None:
    """Drop the local variables of the finished frames in ``error``'s tracebacks (and those of the
    errors it was raised from or during).

    A failed load's buffer (an arena piece) is a local of the frames that raised: without this it
    would stay alive, and out of the arena, as long as the error does, and a load's error is kept
    by every request that asked for the adapter. File names and line numbers stay.
    """
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]
