"""`copy_blocks`: copy or zero a list of 2D blocks anywhere in device memory in one launch.

Writing an adapter into a GPU slot touches every wrapped layer: per output slice an A block and
a B block, the padding past the new rank, a scale, a rank and a pool start, several hundred
blocks for an 8B adapter (`loramux.engine.layers.slot_copy`). Torch issues them as hundreds of
views and calls on the engine's thread, each a point where the GIL can pass to a loader thread;
this kernel takes them as one table of numbers instead:

    table[i] = (dst, src, rows, cols, dst_stride, src_stride)

Addresses are in bytes (``src`` 0: write zeros), everything else in 2-byte units, so one kernel
serves any dtype of an even size (bf16 and fp16 weights, fp32 scales, int32 ranks). A block's
rows are contiguous; its rows are ``*_stride`` units apart. One program a block, looping over it
in tiles: the largest block of an 8B slot (rank 64 of ``down``'s 14,336 columns) is under 2 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TABLE_FIELDS", "copy_blocks"]

#: Columns of a table row: dst, src, rows, cols, dst_stride, src_stride.
TABLE_FIELDS = 6
TILE = 2048


@triton.jit
def _copy_blocks_kernel(table_ptr, TILE: tl.constexpr):
    row = table_ptr + tl.program_id(0) * 6
    dst = tl.load(row).to(tl.pointer_type(tl.int16))
    src_address = tl.load(row + 1)
    rows = tl.load(row + 2)
    cols = tl.load(row + 3)
    dst_stride = tl.load(row + 4)
    src_stride = tl.load(row + 5)
    n = rows * cols
    for start in range(0, n, TILE):
        index = start + tl.arange(0, TILE)
        mask = index < n
        r = index // cols
        c = index - r * cols
        if src_address == 0:
            values = tl.zeros([TILE], dtype=tl.int16)
        else:
            values = tl.load(src_address.to(tl.pointer_type(tl.int16)) + r * src_stride + c, mask=mask)
        tl.store(dst + r * dst_stride + c, values, mask=mask)


def copy_blocks(table: torch.Tensor) -> None:
    """Run ``table`` (int64 ``[n, TABLE_FIELDS]``, on the device whose memory it names) on the
    current stream. Blocks must not overlap one another: programs run in any order."""
    assert table.dtype == torch.int64 and table.dim() == 2 and table.shape[1] == TABLE_FIELDS, table.shape
    if table.shape[0]:
        _copy_blocks_kernel[(table.shape[0],)](table, TILE=TILE)
