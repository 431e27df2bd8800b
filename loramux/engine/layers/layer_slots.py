"""`LayerSlots`: one wrapped layer's part of the adapter weight pool, the GPU memory of its adapters.

Every resident adapter's weights share one pool of rank rows per layer (S-LoRA's unified paging,
`loramux.engine.adapters.rank_pool`), so a slot costs what its adapter's rank needs, not ``max_lora_rank``:

    lora_a       [U, n_slices, in]       rank row j of slice i of a slot at [start + j, i]
                                         (slice-major in memory: a view of [n_slices, U, in])
    lora_b       [U, N]                  N = sum(output_sizes); a slot's B is one [N, w] block
                                         from element start * N of its flat storage (`block`)
    pool_starts  [S] int32               each slot's first row (start); S slots (the pool's)
    scales       [S, n_slices]           float32: the adapter's scaling times the layer's
                                         ``scale_multiplier``; 0 for a slice it leaves alone
    ranks        [S] int32               0: the slot's adapter does not touch this layer

A slot owns ``w = pool_rows(r)`` rows, its rank r on this layer rounded up to `POOL_ROW_ALIGN`
(the rows and columns past the rank zero), so B's blocks stay aligned for vector loads. ``rows``
(a `RankPool`, shared with the layers of its `RowGroups` group) says which rows each slot owns;
``host_ranks`` is ``ranks`` on the host, so the forward skips a layer no active slot touches
without a sync. The adapter weight pool (`loramux.engine.layers.weight_pool`) makes and writes
these; the kernel backend reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loramux.engine.adapters.rank_pool import RankPool
from loramux.kernels.pool import pool_rows

__all__ = ["LayerSlots"]


class LayerSlots(nn.Module):
    """The adapter weights of one wrapped layer (see the module docstring).

    Buffers, so ``model.to(device)`` moves them with the model; not persistent, so a model's
    ``state_dict`` holds its own weights only.

    :param num_slots: adapters resident at once (S).
    :param units: rank rows in the pool (U).
    """

    def __init__(self, *, num_slots: int, max_lora_rank: int, in_features: int, output_sizes: Sequence[int],
                 units: int, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.num_slots, self.max_lora_rank = num_slots, max_lora_rank
        self.in_features, self.output_sizes = in_features, tuple(output_sizes)
        self.n_slices, self.out_features = len(self.output_sizes), sum(self.output_sizes)
        # A is slice-major in memory ([n_slices, U, in], viewed as the [U, n_slices, in] the kernels
        # read through its strides): a slot's rows of one slice are one dense block to copy
        a = torch.zeros(self.n_slices, units, in_features, dtype=dtype, device=device).transpose(0, 1)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", torch.zeros(units, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        int32 = dict(dtype=torch.int32, device=device)
        self.register_buffer("pool_starts", torch.zeros(num_slots, **int32), persistent=False)
        self.register_buffer("scales", torch.zeros(num_slots, self.n_slices, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("ranks", torch.zeros(num_slots, **int32), persistent=False)
        self.rows: RankPool | None = None  # which slot owns which rows: given by the pool's `RowGroups`
        self.host_ranks = [0] * num_slots

    @staticmethod
    def row_bytes(in_features: int, output_sizes: Sequence[int], dtype: torch.dtype) -> int:
        """Bytes of one rank row of a pool (its A rows of every slice and its B row)."""
        return (len(output_sizes) * in_features + sum(output_sizes)) * dtype.itemsize

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # model.half() must not round the scales, nor turn the ranks and starts into floats
        self.scales = self.scales.float()
        self.ranks, self.pool_starts = self.ranks.int(), self.pool_starts.int()
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype adapter weights are stored in (the kernels compute in it)."""
        return self.lora_a.dtype

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes

    def block(self, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's rows: A ``[width, n_slices, in]`` and B ``[N, width]``."""
        N = self.out_features
        return self.lora_a[start : start + width], self.lora_b.view(-1)[start * N : (start + width) * N].view(N, width)

    def slot_weights(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What the kernels read for ``slot``, per output slice: ``(A [r, in], B [size, r])`` at
        the slot's rank r in this layer (views; rows past a slice's own rank are zeros)."""
        r = self.host_ranks[slot]
        rows_a, block_b = self.block(self.rows.start_of(slot) or 0, pool_rows(r))
        offsets = [sum(self.output_sizes[:i]) for i in range(self.n_slices)]
        return [(rows_a[:r, i], block_b[off : off + size, :r]) for i, (off, size) in enumerate(zip(offsets, self.output_sizes))]

    def extra_repr(self) -> str:
        return f"rows={self.lora_b.shape[0]}, dtype={self.dtype}"
