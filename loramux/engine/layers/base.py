"""`BaseLayerWithLoRA`: the contract every LoRA layer wrapper follows, built-in or from a plugin.

A wrapper keeps the model's own layer as ``base_layer`` and, beside it, the weights of the
adapters in its ``max_loras`` GPU slots, in the layouts the kernels take. A layer that runs the
standard shrink and expand (it overrides none of ``apply_lora``, ``set_lora``, ``slot_write``;
or says ``reads_pool = True``, as the embedding does) is *pooled*: every adapter's weights share
one pool of rank rows (`loramux.engine.rank_pool`; S-LoRA's unified paging), so a slot costs
what its adapter's rank needs, not ``max_lora_rank``:

    lora_a_pool       [U, n_slices, in_features]   rank row j of slice i at [start + j, i]
                                (slice-major in memory: a view of [n_slices, U, in_features])
    lora_b_pool       [U, N]    N = sum(output_sizes); a slot's B is one [N, w] block from
                                element start * N of its flat storage (`_pool_block`)
    lora_pool_starts  [max_loras] int32            each slot's first row (start)

where a slot owns ``w = pool_rows(r)`` rows, its rank r on this layer rounded up to
`POOL_ROW_ALIGN` (8; the rows and columns past the rank zero), so B's blocks stay aligned for
vector loads. U is ``max_loras * pool_rows(max_lora_rank)`` by default (room for ``max_loras``
adapters of the largest rank); `LoRAConfig.max_gpu_lora_bytes` sizes it by bytes instead.
Other layers (a plugin's own kernels) keep one zero-padded copy per slot:

    lora_a_stacked  [max_loras, n_slices * R, in_features]     (model dtype and device)
    lora_b_stacked  [max_loras, sum(output_sizes), R]

and both kinds keep

    lora_scales     [max_loras, n_slices] float32
    lora_ranks      [max_loras] int32   (0: the slot's adapter does not touch this layer)

with R = ``max_lora_rank``. ``forward`` is the base layer's output plus, for every token, the
delta of that token's slot, read from the shared `LoRAContext`, all in one custom op
(``loramux::lora_layer``, `lora_forward`); on CUDA, in a step graph, a pooled projection
computes its delta on a side stream beside its base GEMM instead, and one op
(``loramux::lora_delta``, `lora_delta_forward`) returns both for the compiled layer to add
(`LoRAContext.beside` says when). A subclass states its sizes
in ``__init__`` and, when its input is not ``[..., in_features]`` activations, overrides
``apply_lora`` (its delta then runs after the base layer, in order) and, when its base layer's
output is not ``rows_shape(x) + (out_features,)`` in x's dtype, ``rows_shape`` and
``base_output_spec``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
from torch import nn

from loramux.engine.layers.context import LoRAContext
from loramux.engine.layers.lora_op import register_layer
from loramux.engine.layers.side_stream import (beside_streams, delta_beside_base, gemm_carveout, is_big_gemm,
                                                lora_sms_beside)
from loramux.engine.layers.slot_write import Block, SlotWrite, apply_slot_writes, zero_all
from loramux.engine.rank_pool import RankPool
from loramux.kernels import LoRABatchMeta, lora_apply, lora_expand, lora_shrink
from loramux.kernels.pool import pool_rows
from loramux.kernels.tiles import DECODE_MAX_TOKENS
from loramux.registry import LoRAConfig, LoRAModuleWeights

__all__ = ["BaseLayerWithLoRA"]


class BaseLayerWithLoRA(nn.Module):
    """A layer wrapped for multi-LoRA: ``base_layer(x) + scale[slot] * B[slot](A[slot](x))``.

    :param base_layer: the layer to wrap; its parameters are used as they are, never copied.
    :param module_name: its name in the model (``model.layers.0.self_attn.q_proj``).
    :param lora_config: ``max_loras`` and ``max_lora_rank`` size the slot tensors.
    :param in_features: width of the LoRA input (for an embedding: the vocabulary size).
    :param output_sizes: width of each output slice; one slice unless adapters bring one
        A/B pair per slice (a fused layer serving adapters trained on its unfused parts).
    :param slice_names: the adapter module name whose weights fill each slice; defaults to
        ``(module_name,)``.
    :param dtype: dtype of the slot tensors; defaults to the base layer's weight dtype (adapter
        weights are cast on copy, as the kernels compute in the activations' dtype).
    :param device: defaults to the base layer's weight device.
    """

    #: PEFT stores an embedding LoRA as ``lora_embedding_A/B``; the loader marks those.
    is_embedding = False
    #: Whether the layer keeps its adapters in the pool; None: when it overrides none of
    #: ``apply_lora``, ``set_lora``, ``slot_write`` (a subclass whose own ``apply_lora`` reads
    #: the pool says True).
    reads_pool: bool | None = None

    def __init__(
        self,
        base_layer: nn.Module,
        module_name: str,
        lora_config: LoRAConfig,
        *,
        in_features: int,
        output_sizes: Sequence[int],
        slice_names: Sequence[str] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        # a tensor-parallel shard (`loramux.engine.tensor_parallel.sharding.ShardSpec`): the sizes
        # above are this rank's; adapters come whole and are split by `shard_lora`
        self.tp_shard = getattr(base_layer, "loramux_tp", None)
        self.base_layer = base_layer
        self.module_name = module_name
        self.in_features = int(in_features)
        self.output_sizes = tuple(int(size) for size in output_sizes)
        self.out_features = sum(self.output_sizes)
        self.n_slices = len(self.output_sizes)
        self.slice_names = tuple(slice_names) if slice_names is not None else (module_name,)
        if len(self.slice_names) != self.n_slices:
            raise ValueError(
                f"{type(self).__name__}({module_name!r}): {len(self.slice_names)} slice names "
                f"for {self.n_slices} output slices"
            )
        self.max_loras = lora_config.max_loras
        self.max_lora_rank = lora_config.max_lora_rank
        weight = getattr(base_layer, "weight", None)
        dtype = dtype or (weight.dtype if weight is not None else torch.get_default_dtype())
        device = device or (weight.device if weight is not None else None)
        S, R, n = self.max_loras, self.max_lora_rank, self.n_slices
        zeros = dict(dtype=dtype, device=device)
        cls = type(self)
        self.pooled = cls.reads_pool if cls.reads_pool is not None else all(
            getattr(cls, name) is getattr(BaseLayerWithLoRA, name) for name in ("apply_lora", "set_lora", "slot_write"))
        # buffers, so model.to(device) moves them; not persistent, so state_dict is the model's
        if self.pooled:
            self.register_buffer("lora_pool_starts", torch.zeros(S, dtype=torch.int32, device=device),
                                 persistent=False)
            if lora_config.max_gpu_lora_bytes is None:  # one region of the largest rank per slot
                self._new_pool(S * pool_rows(R), dtype, device, region=pool_rows(R))
            else:  # shared by rank; the model manager sizes every pool at once (`resize_pool`)
                self._new_pool(0, dtype, device)
        else:
            self.register_buffer("lora_a_stacked", torch.zeros(S, n * R, self.in_features, **zeros), persistent=False)
            self.register_buffer("lora_b_stacked", torch.zeros(S, self.out_features, R, **zeros), persistent=False)
        self.register_buffer("lora_scales", torch.zeros(S, n, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("lora_ranks", torch.zeros(S, dtype=torch.int32, device=device), persistent=False)
        self._host_ranks = [0] * S  # lora_ranks on the host: skip layers no active slot touches
        self._views: dict[int, tuple] = {}  # slot -> its views, see _slot_views and _slot_cells
        self.lora_context: LoRAContext | None = None  # set by the model manager
        self.computes_logits = False  # the model's LM head (set by patch_model): its rows are the logits rows
        self.layer_id = register_layer(self)  # how the lora ops find this layer
        self.delta_beside = self._delta_beside()
        #: whether the base layer is a plain ``nn.Linear`` without bias (``x @ W.T``, a tensor-parallel
        #: shard too) that a layer with the standard kernels may run as a GEMM onto its delta
        #: (`_gemm_onto_delta`)
        self.plain_linear = self._standard_kernels() and type(base_layer) is nn.Linear and base_layer.bias is None
        # a pooled layer whose GEMM is big: a step graph for adapters that leave every such layer
        # alone runs its base GEMM only (`LoRAContext.skip_big`; the model manager knows, per slot,
        # from the adapter's pool footprint, which only pooled layers have)
        self.big_gemm = self.pooled and is_big_gemm(self.in_features * self.out_features)

    # -- the wrapped layer -------------------------------------------------------------------

    def get_base_layer(self) -> nn.Module:
        return self.base_layer

    @property
    def weight(self) -> torch.Tensor:  # what code reading `model.lm_head.weight` expects
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base_layer, "bias", None)

    def __setattr__(self, name: str, value) -> None:
        # transformers ties embeddings with `output_embeddings.weight = input_embeddings.weight`;
        # keep that working on the wrapped layer
        if name in ("weight", "bias") and "base_layer" in self._modules:
            setattr(self.base_layer, name, value)
        else:
            super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.lora_scales.dtype != torch.float32:  # model.half() must not round the scales
            self.lora_scales = self.lora_scales.float()
        if self.lora_ranks.dtype != torch.int32:
            self.lora_ranks = self.lora_ranks.int()
        if self.pooled and self.lora_pool_starts.dtype != torch.int32:
            self.lora_pool_starts = self.lora_pool_starts.int()
        self.delta_beside = self._delta_beside()
        return self

    def _standard_kernels(self) -> bool:
        """Whether this layer's delta is the standard shrink and expand over its pool (`_store_delta`):
        a pooled layer that does not override ``apply_lora``."""
        return self.pooled and type(self).apply_lora is BaseLayerWithLoRA.apply_lora

    def _delta_beside(self) -> bool:
        """Whether this layer computes its delta beside its base GEMM (`lora_delta_forward`): a
        layer with the standard kernels, on a device where that pays (`delta_beside_base`). A plain
        attribute, read by the traced ``forward``."""
        return self._standard_kernels() and delta_beside_base(self.lora_scales.device)

    def _new_pool(self, units: int, dtype: torch.dtype, device: torch.device | None,
                  region: int | None = None) -> None:
        # A is slice-major in memory ([n_slices, U, in], viewed as the [U, n_slices, in] the kernels
        # read through its strides): a slot's rows of one slice are one dense block, and torch's
        # foreach ops batch only dense tensors (`apply_slot_writes`); row-major, the blocks of a
        # fused layer were n_slices rows apart, and every slot write copied block by block
        a_pool = torch.zeros(self.n_slices, units, self.in_features, dtype=dtype, device=device).transpose(0, 1)
        self.register_buffer("lora_a_pool", a_pool, persistent=False)
        self.register_buffer("lora_b_pool", torch.zeros(units, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self.rank_pool = RankPool(units, region)

    def resize_pool(self, units: int) -> None:
        """Make the pool ``units`` rank rows shared by rank (no adapter may be resident: they
        would be lost)."""
        assert self.pooled, "only a pooled layer has a pool"
        assert not any(self._host_ranks), "resize_pool with adapters in the slots"
        self._new_pool(units, self.lora_dtype, self.lora_scales.device)

    @property
    def pool_row_bytes(self) -> int:
        """Bytes of one rank row of the pool (A and B); 0 for a layer without one."""
        if not self.pooled:
            return 0
        return (self.n_slices * self.in_features + self.out_features) * self.lora_a_pool.element_size()

    @property
    def lora_dtype(self) -> torch.dtype:
        """The dtype adapter weights are stored in (the kernels compute in it)."""
        return (self.lora_a_pool if self.pooled else self.lora_a_stacked).dtype

    def units_for(self, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> int:
        """Pool rows an adapter with these weights takes in this layer: its largest rank here,
        rounded up to `POOL_ROW_ALIGN` (0 without a pool, or when it does not touch the layer)."""
        if not self.pooled:
            return 0
        return pool_rows(max((w.rank for w in weights_by_slice if w is not None), default=0))

    def _pool_block(self, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's rows of the pool: A ``[width, n_slices, in]`` and B ``[N, width]``."""
        N = self.out_features
        return (self.lora_a_pool[start : start + width],
                self.lora_b_pool.view(-1)[start * N : (start + width) * N].view(N, width))

    def extra_repr(self) -> str:
        return (
            f"module_name={self.module_name!r}, in={self.in_features}, out={self.output_sizes}, "
            f"max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}"
        )

    # -- slots ----------------------------------------------------------------------------

    def describe_mismatch(self, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> str | None:
        """Why these weights (a whole adapter's, even for a tensor-parallel shard of the layer)
        cannot go into a slot of this layer, or None when they fit."""
        return self._mismatch(weights_by_slice, *self._adapter_sizes())

    def _adapter_sizes(self) -> tuple[int, tuple[int, ...]]:
        """``(in_features, output_sizes)`` of the whole layer, which adapters are trained for."""
        shard = self.tp_shard
        if shard is None:
            return self.in_features, self.output_sizes
        if shard.style == "row":
            return self.in_features * shard.size, self.output_sizes
        return self.in_features, tuple(size * shard.size for size in self.output_sizes)

    def shard_lora(
        self, weights_by_slice: Sequence[LoRAModuleWeights | None], rank: int | None = None
    ) -> list[LoRAModuleWeights | None]:
        """Rank ``rank``'s part (default: this layer's own rank) of a whole adapter's weights for
        this layer (S-LoRA's split): column-parallel, A whole and the rank's rows of B (per slice);
        row-parallel, the rank's columns of A and B whole. Views; unchanged for a layer that is
        not sharded."""
        shard = self.tp_shard
        if shard is None:
            return list(weights_by_slice)
        rank = shard.rank if rank is None else rank
        parts: list[LoRAModuleWeights | None] = []
        for size, weights in zip(self.output_sizes, weights_by_slice):
            if weights is None:
                parts.append(None)
            elif shard.style == "column":
                parts.append(replace(weights, lora_b=weights.lora_b[rank * size : (rank + 1) * size]))
            else:
                n = self.in_features
                parts.append(replace(weights, lora_a=weights.lora_a[:, rank * n : (rank + 1) * n]))
        return parts

    def _mismatch(
        self, weights_by_slice: Sequence[LoRAModuleWeights | None], in_features: int, output_sizes: tuple[int, ...]
    ) -> str | None:
        for name, out, weights in zip(self.slice_names, output_sizes, weights_by_slice):
            if weights is None:
                continue
            kind = "embedding LoRA (lora_embedding_A/B)" if weights.is_embedding else "LoRA (lora_A/B)"
            if weights.is_embedding != self.is_embedding:
                return (
                    f"module {name!r} holds a {kind} but the model's layer there is a "
                    f"{type(self.base_layer).__name__}"
                )
            if weights.rank > self.max_lora_rank:
                return (
                    f"module {name!r} has rank {weights.rank}, above max_lora_rank="
                    f"{self.max_lora_rank}"
                )
            expected_a, expected_b = (weights.rank, in_features), (out, weights.rank)
            got_a, got_b = tuple(weights.lora_a.shape), tuple(weights.lora_b.shape)
            if got_a != expected_a or got_b != expected_b:
                return (
                    f"module {name!r}: the adapter's A is {list(got_a)} and B is {list(got_b)}, but "
                    f"the model's {type(self.base_layer).__name__} needs A {list(expected_a)} and "
                    f"B {list(expected_b)} ([r, in] and [out, r])"
                )
        return None

    @torch.no_grad()
    def set_lora(self, slot: int, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> None:
        """Copy one adapter's weights into ``slot`` (cast to the slot dtype, zero-padded to R).

        ``weights_by_slice`` holds one entry per output slice; None leaves that slice without
        LoRA. A tensor-parallel shard of a layer takes its part (`shard_lora`). Nothing here
        blocks the host (`loramux.engine.layers.slot_write`); the model manager writes every
        layer of an adapter in one batch of `slot_write` parts instead of calling this per layer.
        """
        apply_slot_writes([self.slot_write(slot, weights_by_slice)])

    def slot_write(self, slot: int, weights_by_slice: Sequence[LoRAModuleWeights | None], *,
                   checked: bool = False) -> SlotWrite:
        """This layer's part of writing an adapter into ``slot`` (see `set_lora`), checked and
        described but not run: the blocks to copy, the padding past the new rank that the slot's
        last adapter wrote (only there: past it the slot is zero already), the scales, the rank.

        :param checked: the weights were validated against this model already (the model
            manager's adapters, by `LoRAModelManager.validate`): skip the shape checks.
        :raises ValueError: the weights do not fit this layer (nothing is written).
        """
        assert 0 <= slot < self.max_loras, f"slot {slot} outside [0, {self.max_loras})"
        assert len(weights_by_slice) == self.n_slices, "one weights entry per output slice"
        problem = None if checked else self._mismatch(weights_by_slice, self.in_features, self.output_sizes)
        if problem is not None:
            raise ValueError(problem)
        if self.pooled:
            return self._pool_write(slot, weights_by_slice)
        R = self.max_lora_rank
        written = self._host_ranks[slot]  # rows/columns past it are zero already
        # until this write completes, a failure's reset_lora must clear whatever it reached
        self._host_ranks[slot] = max([written] + [w.rank for w in weights_by_slice if w is not None])
        slices, scales_row, rank_cell = self._slot_views(slot)
        write = SlotWrite(self, slot, scales_row, rank_cell)
        for (a_rows, b_cols), weights in zip(slices, weights_by_slice):
            r = 0 if weights is None else weights.rank
            if r:
                write.copies.append((Block.of(a_rows if r == R else a_rows[:r]), weights.lora_a))
                write.copies.append((Block.of(b_cols if r == R else b_cols[:, :r]), weights.lora_b))
            if r < written:
                write.zeros += [Block.of(a_rows[r:]), Block.of(b_cols[:, r:])]
            write.scales.append(float(weights.scaling) * self.scale_multiplier() if r else 0.0)
            write.rank = max(write.rank, r)
        return write

    def _pool_write(self, slot: int, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> SlotWrite:
        """`slot_write` for a pooled layer: the slot's rows (its last adapter's freed first), A and
        B copied into them, and zeros where a slice's rank is below the layer's (the rows there
        held another adapter's weights; a kernel reads up to the slot's rank in every slice)."""
        width = self.units_for(weights_by_slice)
        rank = max((w.rank for w in weights_by_slice if w is not None), default=0)
        start = self._take_pool_rows(slot, width, rank)
        scales_row, rank_cell, start_cell = self._slot_cells(slot)
        write = SlotWrite(self, slot, scales_row, rank_cell, start_cell=start_cell, start=start)
        # blocks as numbers, no views (a view per block was most of a write's host time, for
        # every layer of every placement): slice i's A rows are an [r, in] block (the pool is
        # slice-major), and the slot's B is one [N, width] block from element start * N
        a_pool, b_pool = self.lora_a_pool, self.lora_b_pool
        K = self.in_features
        row, slice_stride = a_pool.stride(0), a_pool.stride(1)
        a_row = a_pool.storage_offset() + start * row
        b_row = b_pool.storage_offset() + start * self.out_features
        for i, (size, weights) in enumerate(zip(self.output_sizes, weights_by_slice)):
            r = 0 if weights is None else weights.rank
            a_i = a_row + i * slice_stride  # slice i's first row
            if r:
                write.copies.append((Block(a_pool, a_i, r, K, row), weights.lora_a))  # [r, in]
                write.copies.append((Block(b_pool, b_row, size, r, width), weights.lora_b))  # [size, r]
            # the kernels read A's rows up to the rank, B's columns up to the width
            if r < rank:
                write.zeros.append(Block(a_pool, a_i + r * row, rank - r, K, row))
            if r < width:
                write.zeros.append(Block(b_pool, b_row + r, size, width - r, width))
            write.scales.append(float(weights.scaling) * self.scale_multiplier() if r else 0.0)
            b_row += size * width
        write.rank = rank
        return write

    def _take_pool_rows(self, slot: int, width: int, rank: int) -> int:
        """Give ``slot`` ``width`` rows of the pool for an adapter of ``rank`` here (its previous
        rows freed first) and return the first; checked before anything changes.

        :raises RuntimeError: no room (the model manager makes room before it writes).
        """
        if not self.rank_pool.fits_instead(slot, width):
            raise RuntimeError(
                f"{self.module_name}: no {width} free rows in its LoRA pool of {self.rank_pool.units} "
                f"({self.rank_pool.free_units} free); the model manager makes room before it writes")
        self.rank_pool.free(slot)
        start = self.rank_pool.allocate(slot, width) or 0
        self._host_ranks[slot] = rank  # until this write completes, a failure's reset_lora clears it
        return start

    def _slot_cells(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A pooled layer's ``slot`` entries: its scales row [n_slices], rank cell [1] and pool
        start cell [1] (views made once per slot, as `_slot_views`: every write needs them, for
        every layer)."""
        cached = self._views.get(slot)
        if cached is not None and cached[0] is self.lora_scales:
            return cached[1]
        cells = (self.lora_scales[slot], self.lora_ranks[slot : slot + 1], self.lora_pool_starts[slot : slot + 1])
        self._views[slot] = (self.lora_scales, cells)
        return cells

    def _slot_views(self, slot: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """``slot``'s per-slice views (A rows [R, in], B columns [size, R]), its scales row [n_slices]
        and its rank cell [1], made once: a slot write runs for every wrapped layer, and slicing
        was most of its host time. Made again when the buffers were replaced (``module.to``)."""
        cached = self._views.get(slot)
        if cached is not None and cached[0] is self.lora_a_stacked:
            return cached[1]
        R = self.max_lora_rank
        lora_a, lora_b = self.lora_a_stacked[slot], self.lora_b_stacked[slot]
        offsets = [sum(self.output_sizes[:i]) for i in range(self.n_slices)]
        slices = [(lora_a[i * R : (i + 1) * R], lora_b[offset : offset + size])
                  for i, (offset, size) in enumerate(zip(offsets, self.output_sizes))]
        views = (slices, self.lora_scales[slot], self.lora_ranks[slot : slot + 1])
        self._views[slot] = (self.lora_a_stacked, views)
        return views

    def slot_weights(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What the kernels read for ``slot``, per output slice: ``(A [r, in], B [size, r])`` at the
        slot's rank ``r`` in this layer (views; rows past a slice's own rank are zeros)."""
        r = self._host_ranks[slot]
        offsets = [sum(self.output_sizes[:i]) for i in range(self.n_slices)]
        if self.pooled:
            rows_a, block_b = self._pool_block(self.rank_pool.start_of(slot) or 0, pool_rows(r))
            return [(rows_a[:r, i], block_b[off : off + size, :r])
                    for i, (off, size) in enumerate(zip(offsets, self.output_sizes))]
        R = self.max_lora_rank
        a, b = self.lora_a_stacked[slot], self.lora_b_stacked[slot]
        return [(a[i * R : i * R + r], b[off : off + size, :r])
                for i, (off, size) in enumerate(zip(offsets, self.output_sizes))]

    def reset_lora(self, slot: int) -> None:
        """Clear ``slot``: tokens mapped to it get the base layer's output only."""
        zero_all(self.reset_cells(slot))

    def reset_cells(self, slot: int) -> list[torch.Tensor]:
        """`reset_lora`'s host half: forget ``slot``'s adapter here and return what to zero for it
        (none when it is empty already), so the model manager clears a slot of every layer in a
        call per dtype (`zero_all`). The buffers never require grad: no grad mode is needed."""
        assert 0 <= slot < self.max_loras, f"slot {slot} outside [0, {self.max_loras})"
        if self.pooled:
            self.rank_pool.free(slot)  # its rows' contents stay: no kernel reads them at rank 0
        if self._host_ranks[slot] == 0:
            return []  # already empty: padding is always zero past a slot's rank
        self._host_ranks[slot] = 0
        if self.pooled:
            return list(self._slot_cells(slot)[:2])  # scales and rank
        return [self.lora_a_stacked[slot], self.lora_b_stacked[slot], self.lora_scales[slot],
                self.lora_ranks[slot : slot + 1]]

    def scale_multiplier(self) -> float:
        """A factor the base layer applies to its own output after the product (1 for most)."""
        return 1.0

    # -- forward ------------------------------------------------------------------------------

    def rows_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The leading dims of ``x`` that index tokens (all but the feature dim)."""
        return tuple(x.shape[:-1])

    def base_output_spec(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``base_layer(x)``, which ``torch.compile`` needs before the layer runs:
        ``rows_shape(x) + (out_features,)``, in x's dtype, or autocast's when it is on (a
        projection is a matmul). A wrapper whose base layer returns otherwise overrides it."""
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        return (*self.rows_shape(x), self.out_features), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base_layer(x)`` plus each token's delta; the base layer alone until the model manager
        gives the layer its `LoRAContext`."""
        if self.lora_context is None or (self.big_gemm and self.lora_context.skip_big):
            return self.base_layer(x)
        shape, dtype = self.base_output_spec(x)
        # the LM head runs outside the compiled layers: nothing would fold its sum, which would
        # be a launch of its own over the whole logits, and its delta's buffer zeros to write;
        # in line, a slot without LoRA there costs nothing
        if self.delta_beside and self.lora_context.beside and not self.computes_logits:
            # the delta comes back beside the base output and the sum is traced, so a compiled layer
            # folds it into the pointwise kernel that reads the output next (no launch of its own)
            output, delta = torch.ops.loramux.lora_delta(x, self.layer_id, shape, dtype, self.lora_dtype)
            return output + delta if delta.dtype == dtype else (output + delta).to(dtype)
        # one opaque op for the whole layer (see `lora_forward`): torch.compile traces no per-step
        # Python state
        return torch.ops.loramux.lora_layer(x, self.layer_id, shape, dtype)

    def lora_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base_layer(x)`` plus the delta for the mapping the `LoRAContext` holds now, in a new
        contiguous tensor, base then delta in order (a prefill through a plain linear layer: the
        delta, then the GEMM onto it, `_gemm_onto_delta`): the body of the ``loramux::lora_layer``
        op (the CPU, the torch reference kernels, a subclass that overrides `apply_lora`: the
        embedding's gather, a plugin's kernels). With nothing to add (no mapping, or no active slot
        touches this layer) it is the base layer's output alone: a CUDA graph captured without
        adapters holds no LoRA kernel.
        """
        meta = self._lora_meta(x)
        if meta is not None and self._gemm_onto_delta(x, meta):
            return self._delta_then_gemm(x, meta)
        output = self.base_layer(x).contiguous()
        if meta is None:
            return output
        with self._rows_in_slot_dtype(output) as y:
            self.apply_lora(x, y, meta)
        return output

    def _gemm_onto_delta(self, x: torch.Tensor, meta: LoRABatchMeta) -> bool:
        """Whether `_delta_then_gemm` computes this forward: an eager step of more than
        `DECODE_MAX_TOKENS` tokens (a prefill: the GEMM is compute-bound, and reading the delta in
        its epilogue did not slow it) through a plain bias-free ``nn.Linear`` (`plain_linear`),
        everything in the slot dtype."""
        return (self.plain_linear and not meta.static and meta.num_tokens > DECODE_MAX_TOKENS
                and x.dtype == self.base_layer.weight.dtype == self.lora_dtype
                and not torch.is_autocast_enabled(x.device.type))

    def _delta_then_gemm(self, x: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
        """``base_layer(x)`` plus the delta, the delta first: the shrink, the expand storing each
        row's delta into a buffer of its own (never read), then the base GEMM adding its product
        onto that buffer (``addmm_``: cuBLAS reads it in the epilogue). Adding the delta after the
        GEMM instead reads and writes the output's targeted slices once more in a memory-bound
        kernel, as many bytes as the layer's whole output at a long prefill."""
        x2d = self._lora_input(x)
        delta = torch.empty(meta.num_tokens, self.out_features, dtype=self.lora_dtype, device=x.device)
        if meta.num_lora_tokens < meta.num_tokens or not all(self._host_ranks[s] for s in meta.active_slots_host):
            delta.zero_()  # the expand leaves rows of tokens without an adapter here as they are
        self._store_delta(x2d, delta, meta)
        delta.addmm_(x2d, self.base_layer.weight.t())
        return delta.view(*self.rows_shape(x), self.out_features)

    def lora_delta_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base_layer(x), delta)``, both contiguous and of the output's shape, the delta in the
        slot dtype: the body of the ``loramux::lora_delta`` op, for a layer with `delta_beside`.

        On CUDA the delta is computed on the side stream while the main stream runs the base
        GEMM, which leaves `lora_sms_beside` multiprocessors to it (`gemm_carveout`):

            main:  alloc buf, delta ─┬─ base GEMM (carveout) ─────────────────── wait(side) ─ return
            side:                    └─ wait(main) ─ zero delta ─ shrink ─ expand (store) ─┘

        The GEMM is enqueued before the delta's kernels (the side stream's wait comes before it,
        so the delta does not wait for it): enqueued after them, it ran slower beside them.

        Every fork is joined before the op returns, so a CUDA-graph capture gets a parallel
        branch that ends inside the layer. Elsewhere (tests) the same kernels run in order.
        """
        meta = self._lora_meta(x)
        if meta is None:  # no token of this (eager) step uses an adapter touching this layer
            output = self.base_layer(x).contiguous()
            return output, torch.zeros(output.shape, dtype=self.lora_dtype, device=output.device)
        T, device = meta.num_tokens, x.device
        # made on the main stream, before the fork, so the main stream owns their memory
        buf = torch.empty(T, self.n_slices * self.max_lora_rank, dtype=torch.float32, device=device)  # [T, n*R]
        delta = torch.empty(T, self.out_features, dtype=self.lora_dtype, device=device)  # [T, N]
        sms = lora_sms_beside(T, device, self.in_features * self.out_features)
        streams = beside_streams(device)
        if streams is not None:
            main, side = streams
            side.wait_stream(main)  # x is made on the main stream (and not the GEMM, enqueued after this)
        # the GEMM first: enqueued after the delta's kernels, it runs slower beside them
        with gemm_carveout(sms):
            output = self.base_layer(x).contiguous()  # on the main stream, beside the delta
        with torch.cuda.stream(side) if streams is not None else nullcontext():
            # what this allocates (x cast to the slot dtype, split-K scratch) is used on this stream only
            delta.zero_()  # rows of tokens without an adapter here stay zero
            self._store_delta(self._lora_input(x), delta, meta, buf=buf, sms=sms)
        if streams is not None:
            main.wait_stream(side)  # the join: delta is written, and x's memory is not reused before it is read
        return output, delta.view(output.shape)

    def _store_delta(self, x2d: torch.Tensor, delta: torch.Tensor, meta: LoRABatchMeta, *,
                     buf: torch.Tensor | None = None, sms: int | None = None) -> None:
        """``delta [T, N]`` = each token's delta, in the rows of tokens whose adapter touches this
        layer (zeros in the slices it does not target; other rows left as they are): the shrink of
        ``x2d`` (into ``buf`` when given), then the expand in its store mode; launches sized for
        ``sms`` multiprocessors (None: all)."""
        buf = lora_shrink(x2d, self.lora_a_pool, self.lora_scales, meta, self.lora_ranks, out=buf,
                          pool_starts=self.lora_pool_starts, max_rank=self.max_lora_rank, sms=sms)
        lora_expand(delta, buf, self.lora_b_pool, self.output_sizes, meta, self.lora_ranks,
                    pool_starts=self.lora_pool_starts, sms=sms, store=True, scales=self.lora_scales)

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor, meta: LoRABatchMeta) -> None:
        """``y [T, out] += delta``, in place, for activations ``x [..., in_features]``."""
        if self.pooled:
            lora_apply(y, self._lora_input(x), self.lora_a_pool, self.lora_b_pool, self.lora_scales,
                       self.lora_ranks, self.output_sizes, meta, pool_starts=self.lora_pool_starts,
                       max_rank=self.max_lora_rank)
        else:  # a subclass that overrides apply_lora does not come here, but one may call super()
            lora_apply(y, self._lora_input(x), self.lora_a_stacked, self.lora_b_stacked, self.lora_scales,
                       self.lora_ranks, self.output_sizes, meta)

    def _lora_meta(self, x: torch.Tensor) -> LoRABatchMeta | None:
        """The kernel metadata for input ``x``, or None when no token gets a delta from this layer."""
        rows = self.rows_shape(x)
        meta = self.lora_context.logits_meta_for(rows) if self.computes_logits else self.lora_context.meta_for(rows)
        if meta is None:
            return None
        if not meta.static and not any(self._host_ranks[slot] for slot in meta.active_slots_host):
            return None  # no token of this batch uses an adapter that touches this layer
        return meta

    def _lora_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.in_features).to(self.lora_dtype)  # [T, in]

    @contextmanager
    def _rows_in_slot_dtype(self, output: torch.Tensor) -> Iterator[torch.Tensor]:
        """``output`` as ``[T, out]`` rows for the kernels to add into: a view, or, when the slot
        dtype differs from the output's (autocast, a wrapper built with another ``dtype``), a copy
        in the slot dtype, written back on exit."""
        y = output.view(-1, self.out_features)  # [T, out], shares memory with output
        if y.dtype == self.lora_dtype:
            yield y
            return
        delta_y = y.to(self.lora_dtype)
        yield delta_y
        y.copy_(delta_y)

