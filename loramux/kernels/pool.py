"""The layout of a layer's adapter pool, shared by the kernels, the torch reference and the layers.

A pooled layer keeps every resident adapter in one pool of rank rows (`loramux.engine.layers.base`).
A slot owns ``pool_rows(rank)`` rows from its start: its rank rounded up to `POOL_ROW_ALIGN`, the
rows and columns past the rank zero, so that B's ``[N, width]`` block starts and strides on
16-byte boundaries (2-byte weights) and the expand reads it in whole vectors. No Triton here:
the reference and the layers import it without loading Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["POOL_ROW_ALIGN", "pool_rows"]

POOL_ROW_ALIGN = 8


def pool_rows(rank: int | np.ndarray) -> int | np.ndarray:
    """The rows a slot of this rank owns in a layer's adapter pool (0 for rank 0); elementwise
    for an integer array of ranks."""
    return -(-rank // POOL_ROW_ALIGN) * POOL_ROW_ALIGN
