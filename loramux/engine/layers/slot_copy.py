"""Running a slot write (`loramux.engine.layers.write_plan.WritePlan`) in a handful of device calls.

On CUDA a plan runs as:

- the weights: an adapter's tensors are views into one host buffer (the loader reads a file into
  one buffer; `LoRAAdapter.pack` packs into one), so that buffer goes to the device in ONE copy;
- a table of every block (copy from that copy, or zero; and the scales, ranks and pool starts
  from a few bytes of values), page-locked and copied in one more;
- ONE launch of `loramux.kernels.block_copy.copy_blocks`, which runs the table (`launch_table`).

Why numbers and one kernel: the engine's thread runs slot writes inside its steps, and each torch
call is a point where the GIL may pass to a loader thread. Done with views and torch's foreach
ops a write was hundreds of calls on an 8B adapter (a view per block, a staged view per weight,
the copies), the engine thread's largest cost under churn; as a table it is a dozen
(docs/benchmarks/many_adapters.md: time to first token from host memory).

Nothing blocks the host: the host buffers are page-locked in the CPU tier (elsewhere the copy is
staged, as any pageable copy), and the table comes from PyTorch's pinned allocator. Where the
table cannot express a write (weights that do not share one host buffer, or one much larger than
they are: PEFT may save a whole embedding beside an embedding LoRA; a dtype cast) and on the CPU,
the blocks are copied one by one (`copy_one_by_one`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from loramux.engine.layers.layer_slots import LayerSlots

__all__ = ["COPY_FIELDS", "SlotImage", "Table", "WritePlan", "copy_one_by_one", "launch_table", "shared_buffer",
           "zero_all"]

#: Stage the adapter's whole host buffer only when it is at most this much larger than the
#: blocks the slot needs (a buffer with a saved base embedding beside the LoRA weights is not).
MAX_STAGED_OVERHEAD = 1.5
#: `loramux.kernels.block_copy.TABLE_FIELDS` (not imported here: that module loads Triton).
_FIELDS = 6


#: columns of `WritePlan.copies`: a `copy_blocks` row (dst and src addresses in bytes; rows;
#: columns, dst stride and src stride in 2-byte units), then the block's layer, its pool (0: A,
#: 1: B) and its source (an index into `WritePlan.sources`); `WritePlan.zeros` has no source
COPY_FIELDS = 9


class SlotImage(NamedTuple):
    """An adapter's slot write before it has a slot or rows
    (`loramux.engine.layers.write_plan.WritePlanner.image`): worked out once per adapter."""

    rows: np.ndarray  # int64 [layers]: the pool rows it takes in each layer (its largest rank there, rounded up)
    touched: np.ndarray  # int64 [k]: the layers it writes, in order
    ranks: np.ndarray  # int64 [k]
    scales: np.ndarray  # float32: every slice's scale of the touched layers, in order
    copies: np.ndarray  # int64 [n, COPY_FIELDS], a destination as its offset in its pool from the slot's rows
    zeros: np.ndarray  # int64 [m, COPY_FIELDS - 1], the same
    sources: list[torch.Tensor]  # the weights copied from: each module's A then B
    host: torch.Tensor | None  # uint8 over the one host buffer every copy reads; None: block by block


class WritePlan(NamedTuple):
    """A slot write as numbers (`loramux.engine.layers.write_plan.WritePlanner.plan`); the layers'
    rank-pool rows are taken already."""

    slot: int
    copies: np.ndarray  # int64 [n, COPY_FIELDS]
    zeros: np.ndarray  # int64 [m, COPY_FIELDS - 1]
    touched: np.ndarray  # int64 [k]: the layers it writes, in order
    scales: np.ndarray  # float32: every slice's scale of the touched layers, in order
    ranks: np.ndarray  # int64 [k]
    starts: np.ndarray  # int64 [k]
    sources: list[torch.Tensor]  # the weights copied from: each module's A then B
    #: the one host buffer every copy reads (no cast, rows of contiguous columns, in host memory),
    #: when a `copy_blocks` table can say the write; None: copied block by block
    host: torch.Tensor | None


class Table(NamedTuple):
    """A slot write as `copy_blocks` numbers, before staging: what `launch_table` runs."""

    copies: np.ndarray  # int64 [n, 6]: `copy_blocks` rows of blocks to copy, src a host address in ``host``
    zeros: np.ndarray  # int64 [m, 6]: rows of blocks to zero (src 0)
    cells: np.ndarray  # int64 [k, 2]: (device address, count) of the 4-byte values staged after the table
    values: np.ndarray  # int32 [sum of counts]: the cells' values in order (float32 scales as their bits)
    host: torch.Tensor | None  # uint8 over the one host buffer every copy reads; None without copies


def copy_one_by_one(plan: WritePlan, slots: Sequence[LayerSlots]) -> None:
    """Run ``plan`` with torch copies, a view per block (``slots``: every layer's, in the plan's
    order): the CPU, and weights a table cannot copy as they are (a cast happens on the copy)."""
    device = slots[0].scales.device if slots else torch.device("cpu")

    def block(dst: int, rows: int, cols: int, stride: int, j: int, pool: int) -> torch.Tensor:
        base = slots[j].lora_a if pool == 0 else slots[j].lora_b
        size = base.element_size()  # the row's columns and stride are in 2-byte units
        offset = base.storage_offset() + (dst - base.data_ptr()) // size
        return base.as_strided((rows, cols * 2 // size), (stride * 2 // size, 1), offset)

    for dst, _, rows, cols, stride, _, j, pool, source in plan.copies.tolist():
        block(dst, rows, cols, stride, j, pool).copy_(plan.sources[source], non_blocking=True)  # async from pinned memory
    zero_all([block(dst, rows, cols, stride, j, pool) for dst, _, rows, cols, stride, _, j, pool in plan.zeros.tolist()])
    touched = [slots[j] for j in plan.touched.tolist()]
    scales = np.split(plan.scales, np.cumsum([s.n_slices for s in touched])[:-1]) if touched else []
    _spread([s.scales[plan.slot] for s in touched], [row.tolist() for row in scales], torch.float32, device)
    cells = [s.ranks[plan.slot : plan.slot + 1] for s in touched] + [s.pool_starts[plan.slot : plan.slot + 1]
                                                                     for s in touched]
    _spread(cells, [[v] for v in plan.ranks.tolist() + plan.starts.tolist()], torch.int32, device)


def launch_table(table: Table, device: torch.device, stage: bool = True) -> None:
    """Run ``table`` on ``device``'s current stream: the host buffer in one asynchronous copy,
    the table and the cells' values in one more (page-locked), one `copy_blocks` launch.
    ``stage=False``: the copies read the host buffer where it is, and the table stays in host
    memory (the CPU, under Triton's interpreter)."""
    from loramux.kernels.block_copy import TABLE_FIELDS, copy_blocks

    assert TABLE_FIELDS == _FIELDS
    copies, zeros, cells, values = table.copies.copy(), table.zeros, table.cells, table.values
    rows = len(copies) + len(zeros) + len(cells)
    table_bytes = 8 * TABLE_FIELDS * rows
    staged = torch.empty(table_bytes + 4 * len(values), dtype=torch.uint8, pin_memory=stage)
    on_device = torch.empty_like(staged, device=device) if stage else staged
    # each cell copies its values from the table's own tail, where they are staged
    at = on_device.data_ptr() + table_bytes + 4 * (np.cumsum(cells[:, 1]) - cells[:, 1])
    cell_rows = np.stack([cells[:, 0], at, np.ones_like(at), 2 * cells[:, 1], 0 * at, 0 * at], axis=1)
    if len(copies) and stage:
        weights = torch.empty(table.host.numel(), dtype=torch.uint8, device=device)
        weights.copy_(table.host, non_blocking=True)  # the one copy of the weights
        copies[:, 1] += weights.data_ptr() - table.host.data_ptr()  # read from that copy
    packed = staged.numpy()
    packed[:table_bytes] = np.concatenate([copies, zeros, cell_rows]).view(np.uint8).reshape(-1)
    packed[table_bytes:] = values.view(np.uint8)
    if stage:
        on_device.copy_(staged, non_blocking=True)
    copy_blocks(on_device[:table_bytes].view(torch.int64).view(-1, TABLE_FIELDS))


def shared_buffer(first: torch.Tensor, spans: np.ndarray) -> torch.Tensor | None:
    """The one host buffer (a uint8 tensor over ``first``'s storage) that every span of
    ``spans`` (int64 ``[n, 2]``: address, bytes) lies in, or None: they lie in several, on a
    device, or in one far larger than they are. Spans, not tensors: a plan has its blocks'
    addresses as numbers already, and a walk over an 8B adapter's 448 tensors is Python on the
    engine's thread."""
    if first.device.type != "cpu":
        return None
    storage = first.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    at, size = spans[:, 0], spans[:, 1]
    if len(spans) and (at.min() < start or (at + size).max() > start + nbytes):
        return None
    if nbytes > MAX_STAGED_OVERHEAD * int(size.sum()) + (1 << 20):
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def zero_all(tensors: Sequence[torch.Tensor]) -> None:
    """Zero ``tensors``: the dense ones in one ``_foreach_zero_`` per dtype, the others one by one
    (a list of mixed dtypes, or with one tensor that is not dense, takes the foreach ops' slow
    path on CUDA: a launch per tensor)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if _dense(tensor):
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        else:
            tensor.zero_()
    for group in by_dtype.values():
        torch._foreach_zero_(group)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span with no gap nor overlap, in some order of its
    dimensions (ATen's ``is_non_overlapping_and_dense``, which Python does not expose): what
    torch's foreach ops need of every tensor of a list to run it in a few kernels."""
    if t.is_contiguous():  # nearly every cell: a flag torch keeps, no Python walk
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _spread(rows: list[torch.Tensor], values: list[list[float]], dtype: torch.dtype, device: torch.device) -> None:
    """``rows[i][:] = values[i]``: one host tensor of every value, one copy, one foreach copy."""
    if not rows:
        return
    flat = torch.tensor([v for row in values for v in row], dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    torch._foreach_copy_(rows, list(flat.split([len(row) for row in values])))
