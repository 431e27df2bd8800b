"""Writing an adapter into a GPU slot in a handful of device calls, whatever the number of layers.

A slot write touches every wrapped layer: per output slice an A block and a B block to copy, the
padding the slot's previous adapter left past the new rank to clear, a scale; per layer a rank.
Issued one by one that is ~800 host-side calls for a Llama-3.1-8B adapter on all seven
projections (12.8 ms on an H100 for 84 MB that PCIe moves in ~2-3 ms). `BaseLayerWithLoRA.slot_write`
describes one layer's part (`SlotWrite`, checked, nothing written yet); `apply_slot_writes` runs
the parts of every layer together:

- the weights: an adapter's tensors are views into one host buffer (the loader reads a file into
  one buffer; `LoRAAdapter.pack` packs into one), so that buffer goes to the device in ONE copy,
  and one ``torch._foreach_copy_`` spreads it over the slots' blocks (device to device);
- the padding: one ``torch._foreach_zero_``;
- the scales, ranks and pool starts: one small host tensor each, copied once and spread by
  ``_foreach_copy_``.

The foreach ops run a list in a few kernels only when every tensor in it is dense (no gaps) and
each pair has one layout; a single other tensor sends the whole list down a kernel per tensor
(~450 for an 8B adapter on all seven projections). The pools are laid out for dense blocks
(`BaseLayerWithLoRA._new_pool`; row-major, a fused layer's A blocks were not, so every write took
the slow path), and the few blocks that are not (a slice's rank below the slot's width) go one
by one beside the batched rest. On an H100, slot writes were the engine thread's slowest work in
a trace of 1,000 adapters: 10 ms for one adapter, up to 93 ms in one step
(docs/benchmarks/many-adapters.md, fourteenth session).

Nothing blocks the host: the host buffers are page-locked in the CPU tier (elsewhere the copy is
staged, as any pageable copy), and the small tensors come from PyTorch's pinned allocator. When
the weights do not share one host buffer (or it holds much more than they need: PEFT may save a
whole embedding beside an embedding LoRA), each block is copied on its own, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loramux.engine.layers.base import BaseLayerWithLoRA

__all__ = ["SlotWrite", "apply_slot_writes", "zero_all"]

#: Stage the adapter's whole host buffer only when it is at most this much larger than the
#: blocks the slot needs (a buffer with a saved base embedding beside the LoRA weights is not).
MAX_STAGED_OVERHEAD = 1.5


@dataclass
class SlotWrite:
    """One layer's part of writing an adapter into ``slot``: made by
    `BaseLayerWithLoRA.slot_write`, run by `apply_slot_writes`."""

    layer: BaseLayerWithLoRA
    slot: int
    scales_row: torch.Tensor  # the layer's lora_scales[slot]: [n_slices] float32
    rank_cell: torch.Tensor  # the layer's lora_ranks[slot:slot + 1]: [1] int32
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (slot block, host weights)
    zeros: list[torch.Tensor] = field(default_factory=list)  # padding past the new rank
    scales: list[float] = field(default_factory=list)  # one per output slice
    rank: int = 0
    start_cell: torch.Tensor | None = None  # a pooled layer's lora_pool_starts[slot:slot + 1]: [1] int32
    start: int = 0  # the slot's first pool row


def apply_slot_writes(writes: Sequence[SlotWrite]) -> None:
    """Run every `SlotWrite` (all on one device), batched: see the module docstring."""
    if not writes:
        return
    device = writes[0].layer.lora_scales.device
    copies = [pair for write in writes for pair in write.copies]
    if copies:
        blocks, weights = [list(side) for side in zip(*copies)]
        sources = weights if device.type == "cpu" else _staged(weights, device)
        if sources is not None:
            batched, single = [], []
            for pair in zip(blocks, sources):
                (batched if _same_dense_layout(*pair) else single).append(pair)
            if batched:
                torch._foreach_copy_([block for block, _ in batched], [source for _, source in batched])
            for block, source in single:
                block.copy_(source)
        else:
            for block, tensor in copies:  # non_blocking: asynchronous from pinned memory
                block.copy_(tensor, non_blocking=True)
    zero_all([block for write in writes for block in write.zeros])
    _spread([w.scales_row for w in writes], [w.scales for w in writes], torch.float32, device)
    _spread([w.rank_cell for w in writes], [[w.rank] for w in writes], torch.int32, device)
    pooled = [w for w in writes if w.start_cell is not None]
    if pooled:
        _spread([w.start_cell for w in pooled], [[w.start] for w in pooled], torch.int32, device)
    for write in writes:
        write.layer._host_ranks[write.slot] = write.rank


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
    if t.is_contiguous():  # nearly every block and weight: a flag torch keeps, no Python walk
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a foreach copy between ``a`` and ``b`` takes the fast path: both dense, of one
    size and the same strides (dimensions of size 1 aside)."""
    if a.shape != b.shape:
        return False
    if a.is_contiguous() and b.is_contiguous():  # one shape, both contiguous: one layout
        return True
    return _dense(a) and _dense(b) and all(x == y for x, y, size in zip(a.stride(), b.stride(), a.shape) if size != 1)


def _staged(weights: list[torch.Tensor], device: torch.device) -> list[torch.Tensor] | None:
    """``weights`` as views of one device copy of the host buffer they share, or None to copy
    them one by one (no shared host buffer, or one far larger than they are)."""
    if any(t.device.type != "cpu" for t in weights):
        return None
    storage = weights[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in weights):
        return None
    needed = sum(t.numel() * t.element_size() for t in weights)
    if storage.nbytes() > MAX_STAGED_OVERHEAD * needed + (1 << 20):
        return None
    host = torch.empty(0, dtype=torch.uint8).set_(storage)
    device_copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device)
    device_copy.copy_(host, non_blocking=True)  # the one host-to-device copy
    on_device = device_copy.untyped_storage()
    return [torch.empty(0, dtype=t.dtype, device=device).set_(on_device, t.storage_offset(), t.size(), t.stride())
            for t in weights]


def _spread(rows: list[torch.Tensor], values: list[list[float]], dtype: torch.dtype, device: torch.device) -> None:
    """``rows[i][:] = values[i]``: one host tensor of every value, one copy, one foreach copy."""
    flat = torch.tensor([v for row in values for v in row], dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    torch._foreach_copy_(rows, list(flat.split([len(row) for row in values])))
