"""`PoolWriter`: the `copy_blocks` table of one adapter's slot write into every pooled layer,
computed with numpy.

`BaseLayerWithLoRA.slot_write` describes one layer's part of a slot write (for a pooled layer,
`_pool_write`: its blocks as numbers) and `slot_write.table_of` turns the parts into a table:
Python for every layer and every block. An 8B model has 128 pooled layers, and that Python ran on
the engine's thread before the step that admits the adapter's request could launch: a large part
of the time to first token of a request whose adapter waits in host memory
(docs/benchmarks/throughput.md).

Every number of that table follows from a few per layer (its pools' addresses and strides, read
once) and a few per module of the adapter (its rank, its weights' addresses and row strides, its
scaling): `PoolWriter.table` computes the same `slot_write.Table` for all layers at once. The
Python left per placement is one pass over the adapter's modules and each touched layer's rank
pool allocation. `_pool_write` stays the reference (the tests hold both tables equal) and the
way for everything this does not cover: a layer that writes its slots its own way, a
tensor-parallel shard, the stacked layout, and adapters a table cannot express as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.slot_write import Table, _shared_buffer
from loramux.kernels.pool import POOL_ROW_ALIGN
from loramux.registry import LoRAAdapter

__all__ = ["PoolWriter", "covers"]


def covers(layer: BaseLayerWithLoRA) -> bool:
    """Whether ``layer``'s slot writes are `_pool_write`'s: pooled, not sharded, none of the
    methods on that way overridden."""
    cls = type(layer)
    return (layer.pooled and layer.tp_shard is None and cls.set_lora is BaseLayerWithLoRA.set_lora
            and cls.slot_write is BaseLayerWithLoRA.slot_write and cls._pool_write is BaseLayerWithLoRA._pool_write)


class PoolWriter:
    """The table of a slot write into those of ``layers`` it `covers` (`layers`, in order; `covered`,
    as a set).

    :param layers: the model's wrapped layers.
    """

    def __init__(self, layers: Sequence[BaseLayerWithLoRA]) -> None:
        self.layers = [layer for layer in layers if covers(layer)]
        self.covered = set(self.layers)
        self._slice: dict[str, int] = {}  # module name -> its row in the slice arrays
        slices = []  # (layer index, slice index, output rows, output rows of the slices before it)
        for j, layer in enumerate(self.layers):
            before = 0
            for i, (name, size) in enumerate(zip(layer.slice_names, layer.output_sizes)):
                self._slice[name] = len(slices)
                slices.append((j, i, size, before))
                before += size
        self._layer, self._index, self._size, self._before = np.array(slices, dtype=np.int64).reshape(-1, 4).T
        self._multiplier = np.array([layer.scale_multiplier() for layer in self.layers])
        self._sentinel = None  # the tensor `_current_geometry` checks
        self._geometry: dict[str, np.ndarray] = {}
        self._dtype: list = []  # each slice's pool dtype

    def table(self, slot: int, adapter: LoRAAdapter) -> tuple[Table | None, list[BaseLayerWithLoRA]] | None:
        """Give ``adapter`` its pool rows in ``slot`` of every covered layer it touches and return
        the table that writes it there (None: it touches none), with the covered layers it does
        not touch (their part of the slot is the caller's to clear); None, with nothing changed,
        when a table cannot express its weights as they are (a cast, weights in several host
        buffers).

        :raises RuntimeError: a layer's pool has no room for it (the model manager makes room first).
        """
        g = self._current_geometry()
        found, tensors, scaling = [], [], []
        for name, w in adapter.modules.items():  # the one pass over the adapter's modules
            row = self._slice.get(name)
            if row is None:
                continue
            a, b = w.lora_a, w.lora_b
            if not found and a.device.type != "cpu":
                return None  # weights on a device already (an adapter bound as it is): not one host buffer
            (a_rows, a_cols), (b_rows, b_cols), dtype = a.stride(), b.stride(), self._dtype[row]
            if a.dtype != dtype or b.dtype != dtype or a_cols != 1 and a.shape[1] != 1 or b_cols != 1 and b.shape[1] != 1:
                return None  # a cast, or columns apart: not a block copy
            found.append((row, a.shape[0], a.data_ptr(), b.data_ptr(), a_rows, b_rows))
            tensors += (a, b)
            scaling.append(float(w.scaling))
        if not found:
            return None, self.layers
        host = _shared_buffer(tensors)
        if host is None:
            return None
        rows = np.array([f[0] for f in found], dtype=np.int64)
        per_slice = np.zeros((len(self._layer), 6), dtype=np.int64)  # (row), rank, A and B addresses, row strides
        per_slice[rows] = found
        scalings = np.zeros(len(self._layer))
        scalings[rows] = scaling
        rank = np.zeros(len(self.layers), dtype=np.int64)
        np.maximum.at(rank, self._layer[rows], per_slice[rows, 1])
        width = -(-rank // POOL_ROW_ALIGN) * POOL_ROW_ALIGN
        touched = np.flatnonzero(rank)
        start = np.zeros(len(self.layers), dtype=np.int64)
        for j in touched.tolist():  # as `_pool_write` takes them
            start[j] = self.layers[j]._take_pool_rows(slot, int(width[j]), int(rank[j]))
        table = self._table_for(g, slot, per_slice, scalings, rank, width, start, touched, host)
        untouched = [layer for j, layer in enumerate(self.layers) if not rank[j]]
        return table, untouched

    def _table_for(self, g, slot, per_slice, scaling, rank, width, start, touched, host) -> Table:
        """The table, over every slice of the touched layers (one it leaves out still gets zeros)."""
        s = np.flatnonzero(np.isin(self._layer, touched))  # slices, layer by layer, in order
        j, i, size, before = self._layer[s], self._index[s], self._size[s], self._before[s]
        _, r, src_a, src_b, stride_a, stride_b = per_slice[s].T
        itemsize, units = g["itemsize"][j], g["itemsize"][j] // 2
        a_row = g["a_row"][j]  # elements between a pool's A rows
        a_dst = g["a_ptr"][j] + (start[j] * a_row + i * g["a_slice"][j]) * itemsize  # the slice's first A row
        b_dst = g["b_ptr"][j] + (start[j] * g["out"][j] + width[j] * before) * itemsize  # its [size, width] B block
        k_units, a_stride = g["in"][j] * units, a_row * units
        copy = r > 0
        copies = np.concatenate([
            _stack(a_dst, src_a, r, k_units, a_stride, stride_a * units)[copy],
            _stack(b_dst, src_b, size, r * units, width[j] * units, stride_b * units)[copy]])
        zeros = np.concatenate([  # the kernels read A's rows up to the rank, B's columns up to the width
            _stack(a_dst + r * a_row * itemsize, 0, rank[j] - r, k_units, a_stride, 0)[r < rank[j]],
            _stack(b_dst + r * itemsize, 0, size, (width[j] - r) * units, width[j] * units, 0)[r < width[j]]])
        t = touched  # each touched layer's scales row, rank cell and pool start cell at the slot
        cells = np.concatenate([
            np.stack([g["scales"][t] + slot * g["scales_row"][t], g["slices"][t]], axis=1),
            np.stack([g["ranks"][t] + slot * 4, np.ones_like(t)], axis=1),
            np.stack([g["starts"][t] + slot * 4, np.ones_like(t)], axis=1)])
        scales = np.where(copy, scaling[s] * self._multiplier[j], 0.0).astype(np.float32).view(np.int32)
        values = np.concatenate([scales, rank[t].astype(np.int32), start[t].astype(np.int32)])
        return Table(copies, zeros, cells, values, host)

    def _current_geometry(self) -> dict[str, np.ndarray]:
        """Each covered layer's pools as numbers (addresses in bytes, strides in elements). Read
        again when the pools were replaced: the model manager sizes them all at once before its
        first write, and ``module.to`` moves them all, so the first layer's A pool tells."""
        if self.layers and self.layers[0].lora_a_pool is not self._sentinel:
            self._sentinel = self.layers[0].lora_a_pool
            self._geometry = self._read_geometry()
        return self._geometry

    def _read_geometry(self) -> dict[str, np.ndarray]:
        buffers = [(layer.lora_a_pool, layer.lora_b_pool, layer.lora_scales, layer.lora_ranks, layer.lora_pool_starts)
                   for layer in self.layers]
        for a, b, scales, ranks, starts in buffers:
            assert a.stride(2) == 1 and b.is_contiguous() and ranks.stride(0) == starts.stride(0) == 1
            assert ranks.element_size() == starts.element_size() == scales.element_size() == 4
        self._dtype = [buffers[j][0].dtype for j in self._layer.tolist()]  # per slice
        columns = {
            "a_ptr": [a.data_ptr() for a, *_ in buffers], "a_row": [a.stride(0) for a, *_ in buffers],
            "a_slice": [a.stride(1) for a, *_ in buffers], "b_ptr": [b.data_ptr() for _, b, *_ in buffers],
            "itemsize": [a.element_size() for a, *_ in buffers],
            "in": [layer.in_features for layer in self.layers], "out": [layer.out_features for layer in self.layers],
            "scales": [s.data_ptr() for *_, s, _, _ in buffers], "scales_row": [4 * s.stride(0) for *_, s, _, _ in buffers],
            "slices": [layer.n_slices for layer in self.layers],
            "ranks": [r.data_ptr() for *_, r, _ in buffers], "starts": [t.data_ptr() for *_, t in buffers],
        }
        return {name: np.array(values, dtype=np.int64) for name, values in columns.items()}


def _stack(*columns) -> np.ndarray:
    """`copy_blocks` rows from columns (arrays of one length, or scalars)."""
    return np.stack(np.broadcast_arrays(*columns), axis=1).astype(np.int64, copy=False)
