"""`WritePlanner`: the one computation of a slot write, for every wrapped layer at once, with numpy.

Writing an adapter into a slot touches every wrapped layer: per output slice an A block and a B
block to copy into the rows the slot takes in the layer's pool, the padding past the slice's rank
to clear (the rows held another adapter's weights; a kernel reads up to the slot's rank in every
slice, and B's columns up to its rows), and per layer the scales, the rank and the pool start.
Every number of that follows from a few per layer (its pools' addresses and strides, read once)
and a few per module of the adapter (its rank, its weights' addresses and row strides, its
scaling), so the plan is numpy over arrays, never Python per block. An 8B model has 128 pooled
projections: described layer by layer and block by block, a write is hundreds of Python steps per
adapter on the engine's thread, all of them before the step that admits the adapter's request can
launch.

So a write is computed in two parts. `WritePlanner.image` does all that depends on the adapter
alone, once per adapter and off the engine's thread (as its load is validated): the one pass over
its modules, every block with its destination as an offset in its pool, the scales, the host
buffer a table copies. `WritePlanner.plan` does what depends on the slot, on the engine's thread:
a rank-pool allocation per group of layers written alike (`RowGroups`), then each destination
moved to the pool's address and the slot's rows, a few numpy operations.

The plan is run by `loramux.engine.layers.slot_copy`: as one `copy_blocks` table on CUDA
(`WritePlanner.table`), or block by block where a table cannot say it (the CPU, a cast, weights
that share no host buffer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from loramux.engine.adapters.rank_pool import RowGroups
from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.slot_copy import COPY_FIELDS, SlotImage, Table, WritePlan, shared_buffer
from loramux.kernels.pool import pool_rows
from loramux.registry import LoRAModuleWeights

__all__ = ["WritePlanner"]


class WritePlanner:
    """Plans slot writes into ``layers`` (their `LayerSlots` given already).

    :param layers: the wrapped layers, in the pool's order.
    :param rows: their pools' rows, which a plan allocates.
    """

    def __init__(self, layers: Sequence[BaseLayerWithLoRA], rows: RowGroups) -> None:
        self.layers = list(layers)
        self.rows = rows
        #: each layer's `LayerSlots`, read once: a submodule's lookup is slow, and a write or a clear
        #: visits a hundred of them
        self.slots = [layer.slots for layer in self.layers]
        self._slice: dict[str, int] = {}  # module name -> its row in the slice arrays
        slices = []  # (layer index, slice index, output rows, output rows of the slices before it)
        for j, layer in enumerate(self.layers):
            before = 0
            for i, (name, size) in enumerate(zip(layer.slice_names, layer.output_sizes)):
                self._slice[name] = len(slices)
                slices.append((j, i, size, before))
                before += size
        self._layer, self._index, self._size, self._before = np.array(slices, dtype=np.int64).reshape(-1, 4).T
        # (the first layer's A pool, the geometry read from the pools, each slice's pool dtype):
        # replaced whole, as threads may read it at once (`image` runs on loading threads)
        self._pools: tuple = (None, {}, [])

    def layer_of(self, module: str) -> tuple[BaseLayerWithLoRA, int] | None:
        """The layer a module's weights fill, and its slice there."""
        row = self._slice.get(module)
        return None if row is None else (self.layers[int(self._layer[row])], int(self._index[row]))

    def image(self, modules: Mapping[str, LoRAModuleWeights]) -> SlotImage:
        """Work out the write of ``modules`` (an adapter's, validated against this model; a
        tensor-parallel rank's part) but its slot and rows: every block, scale and rank. It reads
        only the adapter and the layers' shapes, never the pools' state, so it may run on any
        thread (the engine runs it as a load is validated, on its loading thread)."""
        _, g, dtypes = self._read_pools()
        slice_of = self._slice.get
        found, tensors, scaling = [], [], []
        first = next(iter(modules.values()), None)
        # weights on a device already (an adapter bound as it is) are in no host buffer
        table_ok = first is not None and first.lora_a.device.type == "cpu"
        for name, w in modules.items():  # the one pass over the adapter's modules
            row = slice_of(name)
            if row is None:
                continue
            a, b = w.lora_a, w.lora_b
            try:
                (a_rows, a_cols), (b_rows, b_cols) = a.stride(), b.stride()
            except ValueError:  # not matrices: a layout the layer maps (a convolution's)
                w = self.layers[int(self._layer[row])].adapter_matrices(w)
                a, b = w.lora_a, w.lora_b
                (a_rows, a_cols), (b_rows, b_cols) = a.stride(), b.stride()
            dtype = dtypes[row]
            if table_ok and (a.dtype != dtype or b.dtype != dtype or a_cols != 1 and a.shape[1] != 1
                             or b_cols != 1 and b.shape[1] != 1):
                table_ok = False  # a cast, or columns apart: copied block by block
            found.append((row, a.shape[0], a.data_ptr(), b.data_ptr(), a_rows, b_rows, 2 * len(scaling)))
            tensors += (a, b)
            scaling.append(float(w.scaling))
        per_slice = np.zeros((len(self._layer), 7), dtype=np.int64)  # (row), rank, A and B addresses, strides, source
        scalings = np.zeros(len(self._layer))
        rows = np.array([f[0] for f in found], dtype=np.int64)
        if found:
            per_slice[rows] = found
            scalings[rows] = scaling
        rank = self._layer_ranks(rows, per_slice[rows, 1])
        width = pool_rows(rank)
        touched = np.flatnonzero(rank)
        s = np.flatnonzero(np.isin(self._layer, touched))  # the touched layers' slices, in order
        copies, zeros = self._blocks(g, s, per_slice, rank, width)
        scales = np.where(per_slice[s, 1] > 0, scalings[s] * g["multiplier"][self._layer[s]], 0.0).astype(np.float32)
        # the one host buffer every copy reads (a block's span: its rows but the last at the
        # source's stride, then the last), when a table can say the write
        host = None
        if table_ok and tensors:
            host = shared_buffer(tensors[0], np.stack(
                [copies[:, 1], 2 * ((copies[:, 2] - 1) * copies[:, 5] + copies[:, 3])], axis=1))
        return SlotImage(width, touched, rank[touched], scales, copies, zeros, tensors, host)

    def _layer_ranks(self, rows: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Each layer's largest rank over the slices ``rows`` (of ranks ``ranks``), 0 where none."""
        rank = np.zeros(len(self.layers), dtype=np.int64)
        np.maximum.at(rank, self._layer[rows], ranks)
        return rank

    def plan(self, slot: int, image: SlotImage) -> WritePlan:
        """Give the adapter of ``image`` rows in ``slot`` of every layer it touches and return the
        plan that writes it there. ``slot`` must own no rows (the pool clears a slot before it is
        written again).

        :raises RuntimeError: a layer's pool has no room (the model manager makes room first);
            nothing changed.
        """
        start = self.rows.allocate(slot, image.rows)
        touched = image.touched
        if start is None:
            short = self.rows.short(image.rows)
            j = next(j for j in touched.tolist() if self.slots[j].rows in short)
            pool = self.slots[j].rows
            raise RuntimeError(
                f"{self.layers[j].module_name}: no {int(image.rows[j])} free rows in its LoRA pool of "
                f"{pool.units} ({pool.free_units} free); the model manager makes room before it writes")
        for j, r in zip(touched.tolist(), image.ranks.tolist()):
            self.slots[j].host_ranks[slot] = r  # until the write completes, a failure's clear zeroes it
        g = self.geometry()
        copies, zeros = image.copies.copy(), image.zeros.copy()
        for blocks in (copies, zeros):  # the pool's address, and the slot's first row in it
            j, pool = blocks[:, 6], blocks[:, 7]
            blocks[:, 0] += g["base"][pool, j] + start[j] * g["row_bytes"][pool, j]
        return WritePlan(slot, copies, zeros, touched, image.scales, image.ranks, start[touched], image.sources,
                         image.host)

    def _blocks(self, g, s, per_slice, rank, width) -> tuple[np.ndarray, np.ndarray]:
        """The blocks to copy and to zero, as `copy_blocks` rows (addresses in bytes, the rest in
        2-byte units; a destination as its offset in its pool were the slot's rows to start at 0)
        with each block's layer and pool (and its source, for a copy), over the slices ``s`` of
        the touched layers (one the adapter leaves out still gets zeros)."""
        j, i, size, before = self._layer[s], self._index[s], self._size[s], self._before[s]
        _, r, src_a, src_b, stride_a, stride_b, source = per_slice[s].T
        itemsize, units = g["itemsize"][j], g["itemsize"][j] // 2
        a_row, w = g["a_row"][j], width[j]  # elements between a pool's A rows; the slot's rows
        a_dst = i * g["a_slice"][j] * itemsize  # the slice's first A row
        b_dst = w * before * itemsize  # its [size, width] B block
        k_units, a_stride = g["in"][j] * units, a_row * units
        copy = r > 0
        copies = np.concatenate([
            _stack(a_dst, src_a, r, k_units, a_stride, stride_a * units, j, 0, source)[copy],
            _stack(b_dst, src_b, size, r * units, w * units, stride_b * units, j, 1, source + 1)[copy]])
        zeros = np.concatenate([  # the kernels read A's rows up to the rank, B's columns up to the width
            _stack(a_dst + r * a_row * itemsize, 0, rank[j] - r, k_units, a_stride, 0, j, 0)[r < rank[j]],
            _stack(b_dst + r * itemsize, 0, size, (w - r) * units, w * units, 0, j, 1)[r < w]])
        return copies.reshape(-1, COPY_FIELDS), zeros.reshape(-1, COPY_FIELDS - 1)

    def table(self, plan: WritePlan) -> Table | None:
        """``plan`` as one `copy_blocks` table, or None where a table cannot say it (a cast,
        weights in device memory or in several host buffers)."""
        if len(plan.copies) and plan.host is None:
            return None
        g, t, slot = self.geometry(), plan.touched, plan.slot
        cells = np.concatenate([self._scale_and_rank_cells(slot, t),  # and each touched layer's pool start
                                np.stack([g["starts"][t] + slot * 4, np.ones_like(t)], axis=1)])
        values = np.concatenate([plan.scales.view(np.int32), plan.ranks.astype(np.int32), plan.starts.astype(np.int32)])
        return Table(plan.copies[:, :6], plan.zeros[:, :6], cells, values, plan.host)

    def clear_table(self, slot: int, layers: Sequence[int]) -> Table:
        """Zeroing ``slot``'s scales and rank in ``layers`` (indices) as one `copy_blocks` table:
        a clear on CUDA in one launch, not two tensor views and a zero per layer."""
        cells = self._scale_and_rank_cells(slot, np.asarray(layers, dtype=np.int64))
        empty = np.zeros((0, 6), dtype=np.int64)
        return Table(empty, empty, cells, np.zeros(int(cells[:, 1].sum()), dtype=np.int32), None)

    def _scale_and_rank_cells(self, slot: int, layers: np.ndarray) -> np.ndarray:
        """(device address, count of 4-byte values) of ``slot``'s scales row in each of ``layers``,
        then of its rank cell in each."""
        g, t = self.geometry(), layers
        return np.concatenate([np.stack([g["scales"][t] + slot * g["scales_row"][t], g["slices"][t]], axis=1),
                               np.stack([g["ranks"][t] + slot * 4, np.ones_like(t)], axis=1)])

    def geometry(self) -> dict[str, np.ndarray]:
        """Each layer's pools as numbers (addresses in bytes, strides in elements) and its
        scale multiplier. Read again when the pools were replaced: ``module.to`` moves them all,
        so the first layer's A pool tells."""
        return self._read_pools()[1]

    def _read_pools(self) -> tuple:
        """``_pools``, read again when the pools were replaced."""
        pools = self._pools
        if self.slots and self.slots[0].lora_a is not pools[0]:
            dtypes = [self.slots[j].dtype for j in self._layer.tolist()]
            pools = self._pools = (self.slots[0].lora_a, self._read_geometry(), dtypes)
        return pools

    def _read_geometry(self) -> dict[str, np.ndarray]:
        slots = self.slots
        for s in slots:
            assert s.lora_a.stride(2) == 1 and s.lora_b.is_contiguous() and s.ranks.stride(0) == s.pool_starts.stride(0) == 1
        columns = {
            "a_ptr": [s.lora_a.data_ptr() for s in slots], "a_row": [s.lora_a.stride(0) for s in slots],
            "a_slice": [s.lora_a.stride(1) for s in slots], "b_ptr": [s.lora_b.data_ptr() for s in slots],
            "itemsize": [s.lora_a.element_size() for s in slots],
            "in": [s.in_features for s in slots], "out": [s.out_features for s in slots],
            "scales": [s.scales.data_ptr() for s in slots], "scales_row": [4 * s.scales.stride(0) for s in slots],
            "slices": [s.n_slices for s in slots],
            "ranks": [s.ranks.data_ptr() for s in slots], "starts": [s.pool_starts.data_ptr() for s in slots],
        }
        geometry = {name: np.array(values, dtype=np.int64) for name, values in columns.items()}
        # by pool (0: A, 1: B) and layer: its address, and the bytes between two of its rank rows
        geometry["base"] = np.stack([geometry["a_ptr"], geometry["b_ptr"]])
        geometry["row_bytes"] = np.stack([geometry["a_row"], geometry["out"]]) * geometry["itemsize"]
        geometry["multiplier"] = np.array([layer.scale_multiplier() for layer in self.layers], dtype=np.float64)
        return geometry


def _stack(*columns) -> np.ndarray:
    """Rows from columns (arrays of one length, or scalars)."""
    return np.stack(np.broadcast_arrays(*columns), axis=1).astype(np.int64, copy=False)
