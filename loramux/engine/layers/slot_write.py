"""Writing an adapter into a GPU slot in a handful of device calls, whatever the number of layers.

A slot write touches every wrapped layer: per output slice an A block and a B block to copy, the
padding the slot's previous adapter left past the new rank to clear, a scale; per layer a rank
and a pool start. `BaseLayerWithLoRA.slot_write` describes one layer's part (`SlotWrite`,
checked, nothing written yet), its blocks as numbers (`Block`: no tensor views);
`apply_slot_writes` runs the parts of every layer together. On CUDA that is:

- the weights: an adapter's tensors are views into one host buffer (the loader reads a file into
  one buffer; `LoRAAdapter.pack` packs into one), so that buffer goes to the device in ONE copy;
- a table of every block (copy from that copy, or zero; and the scales, ranks and pool starts
  from a few bytes of values), page-locked and copied in one more;
- ONE launch of `loramux.kernels.block_copy.copy_blocks`, which runs the table.

Why numbers and one kernel: the engine's thread runs slot writes inside its steps, and each torch
call is a point where the GIL may pass to a loader thread. Done with views and torch's foreach
ops a write was ~600 calls on an 8B adapter (a view per block, a staged view per weight, the
copies), the engine thread's largest cost under churn; now it is a dozen.

Nothing blocks the host: the host buffers are page-locked in the CPU tier (elsewhere the copy is
staged, as any pageable copy), and the table comes from PyTorch's pinned allocator. Where the
table cannot express a write (weights that do not share one host buffer, or one much larger than
they are: PEFT may save a whole embedding beside an embedding LoRA; a dtype cast; an odd-sized
dtype) and on the CPU, the blocks are copied one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from loramux.engine.layers.base import BaseLayerWithLoRA

__all__ = ["Block", "SlotWrite", "Table", "apply_slot_writes", "launch_table", "table_of", "zero_all"]

#: Stage the adapter's whole host buffer only when it is at most this much larger than the
#: blocks the slot needs (a buffer with a saved base embedding beside the LoRA weights is not).
MAX_STAGED_OVERHEAD = 1.5
#: `loramux.kernels.block_copy.TABLE_FIELDS` (not imported here: that module loads Triton).
_FIELDS = 6


class Block(NamedTuple):
    """A 2D block of ``base``'s storage, as numbers: ``base.as_strided((rows, cols), (stride, 1),
    offset)`` (``offset`` in elements from the storage's start, as ``as_strided`` takes it)."""

    base: torch.Tensor
    offset: int
    rows: int
    cols: int
    stride: int

    @classmethod
    def of(cls, view: torch.Tensor) -> Block:
        """The block a 2D view with contiguous rows covers."""
        assert view.dim() == 2 and (view.stride(1) == 1 or view.shape[1] == 1), "a 2D view with contiguous rows"
        return cls(view, view.storage_offset(), view.shape[0], view.shape[1], view.stride(0))

    def view(self) -> torch.Tensor:
        return self.base.as_strided((self.rows, self.cols), (self.stride, 1), self.offset)


@dataclass
class SlotWrite:
    """One layer's part of writing an adapter into ``slot``: made by
    `BaseLayerWithLoRA.slot_write`, run by `apply_slot_writes`."""

    layer: BaseLayerWithLoRA
    slot: int
    scales_row: torch.Tensor  # the layer's lora_scales[slot]: [n_slices] float32
    rank_cell: torch.Tensor  # the layer's lora_ranks[slot:slot + 1]: [1] int32
    copies: list[tuple[Block, torch.Tensor]] = field(default_factory=list)  # (slot block, host weights [rows, cols])
    zeros: list[Block] = field(default_factory=list)  # padding past the new rank
    scales: list[float] = field(default_factory=list)  # one per output slice
    rank: int = 0
    start_cell: torch.Tensor | None = None  # a pooled layer's lora_pool_starts[slot:slot + 1]: [1] int32
    start: int = 0  # the slot's first pool row


def apply_slot_writes(writes: Sequence[SlotWrite]) -> None:
    """Run every `SlotWrite` (all on one device): see the module docstring."""
    if not writes:
        return
    device = writes[0].layer.lora_scales.device
    if device.type != "cuda" or not _run_as_table(writes, device):
        for write in writes:
            for block, weights in write.copies:  # non_blocking: asynchronous from pinned memory
                block.view().copy_(weights, non_blocking=True)
        zero_all([block.view() for write in writes for block in write.zeros])
        _spread([w.scales_row for w in writes], [w.scales for w in writes], torch.float32, device)
        _spread([w.rank_cell for w in writes], [[w.rank] for w in writes], torch.int32, device)
        pooled = [w for w in writes if w.start_cell is not None]
        if pooled:
            _spread([w.start_cell for w in pooled], [[w.start] for w in pooled], torch.int32, device)
    for write in writes:
        write.layer._host_ranks[write.slot] = write.rank


def _run_as_table(writes: Sequence[SlotWrite], device: torch.device, stage: bool = True) -> bool:
    """Run ``writes`` as one `copy_blocks` table (see the module docstring); False, with nothing
    done, when the table cannot express them. ``stage=False`` reads the weights where they are
    (host memory: the CPU tests, under Triton's interpreter)."""
    table = table_of(writes)
    if table is None:
        return False
    launch_table(table, device, stage)
    return True


class Table(NamedTuple):
    """A slot write as numbers, before staging: what `launch_table` runs."""

    copies: np.ndarray  # int64 [n, 6]: `copy_blocks` rows of blocks to copy, src a host address in ``host``
    zeros: np.ndarray  # int64 [m, 6]: rows of blocks to zero (src 0)
    cells: np.ndarray  # int64 [k, 2]: (device address, count) of the 4-byte values staged after the table
    values: np.ndarray  # int32 [sum of counts]: the cells' values in order (float32 scales as their bits)
    host: torch.Tensor | None  # uint8 over the one host buffer every copy reads; None without copies


def table_of(writes: Sequence[SlotWrite]) -> Table | None:
    """``writes`` as a `Table`, or None when a table cannot express them (weights that do not
    share one host buffer, a cast, a dtype of odd size)."""
    copies = [pair for write in writes for pair in write.copies]
    host = _shared_buffer([weights for _, weights in copies]) if copies else None
    if copies and host is None:
        return None
    starts: dict[int, int] = {}  # storage start addresses by id(base): a layer's pools hold many blocks

    def address(block: Block) -> int:
        base = block.base
        start = starts.get(id(base)) or starts.setdefault(id(base), _storage_start(base))
        return start + block.offset * base.dtype.itemsize

    copy_rows, zero_rows = [], []
    for block, weights in copies:
        dtype, strides = weights.dtype, weights.stride()
        if dtype != block.base.dtype or dtype.itemsize % 2 or strides[-1] != 1 and block.cols != 1:
            return None  # a cast, or a dtype of odd size
        units = dtype.itemsize // 2
        copy_rows.append((address(block), weights.data_ptr(), block.rows, block.cols * units,
                          block.stride * units, strides[0] * units))
    for write in writes:
        for block in write.zeros:
            size = block.base.dtype.itemsize
            if size % 2:
                return None
            zero_rows.append((address(block), 0, block.rows, block.cols * size // 2, block.stride * size // 2, 0))
    # the scales (float32) and the ranks and pool starts (int32)
    cells = [(w.scales_row.data_ptr(), len(w.scales)) for w in writes] + [(w.rank_cell.data_ptr(), 1) for w in writes]
    cells += [(w.start_cell.data_ptr(), 1) for w in writes if w.start_cell is not None]
    values = np.concatenate([np.array([s for w in writes for s in w.scales], dtype=np.float32).view(np.int32),
                             np.array([w.rank for w in writes] + [w.start for w in writes if w.start_cell is not None],
                                      dtype=np.int32)])
    return Table(_rows(copy_rows), _rows(zero_rows), np.array(cells, dtype=np.int64).reshape(-1, 2), values, host)


def _rows(rows: list[tuple[int, ...]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, _FIELDS)


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


def _storage_start(t: torch.Tensor) -> int:
    """The address of the first element of ``t``'s storage."""
    return t.data_ptr() - t.storage_offset() * t.dtype.itemsize


def _shared_buffer(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The one host buffer (a uint8 tensor over its storage) every tensor of ``weights`` lies in,
    or None: they lie in several, on a device, or in one far larger than they are."""
    first = weights[0]
    if first.device.type != "cpu":
        return None
    storage = first.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    needed = 0
    for t in weights:
        at, size = t.data_ptr(), t.nbytes
        if not start <= at <= start + nbytes - size:
            return None
        needed += size
    if nbytes > MAX_STAGED_OVERHEAD * needed + (1 << 20):
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
    flat = torch.tensor([v for row in values for v in row], dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    torch._foreach_copy_(rows, list(flat.split([len(row) for row in values])))
