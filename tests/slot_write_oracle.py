"""A slot write spelled out layer by layer with torch views: the oracle the adapter weight pool's
one write path (`AdapterWeightPool.write`: a numpy plan, run as one `copy_blocks` table or block
by block) is held equal to, buffer for buffer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from loramux.engine.adapters.rank_pool import RankPool
from loramux.engine.layers import BaseLayerWithLoRA
from loramux.kernels.pool import pool_rows
from loramux.registry import LoRAModuleWeights


@torch.no_grad()
def write_layer(layer: BaseLayerWithLoRA, slot: int, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> None:
    """``slot`` of one layer: its last rows freed, ``pool_rows(rank)`` rows taken, A and B copied
    (cast on the copy), zeros past each slice's rank up to what the kernels read (A's rows up to
    the layer's rank, B's columns up to the rows), the scales, rank and start set."""
    s = layer.slots
    rank = max((w.rank for w in weights_by_slice if w is not None), default=0)
    if rank == 0:
        clear_layer(layer, slot)
        return
    width = pool_rows(rank)
    rows = own_rows(layer)
    rows.free(slot)
    start = rows.allocate(slot, width)
    rows_a, block_b = s.block(start, width)
    offset = 0
    for i, (size, w) in enumerate(zip(layer.output_sizes, weights_by_slice)):
        r = 0 if w is None else w.rank
        a, b = rows_a[:, i], block_b[offset : offset + size]  # [width, in], [size, width]
        if r:
            a[:r].copy_(w.lora_a)
            b[:, :r].copy_(w.lora_b)
        a[r:rank].zero_()
        b[:, r:].zero_()
        s.scales[slot, i] = float(w.scaling) * layer.scale_multiplier() if r else 0.0
        offset += size
    s.ranks[slot], s.pool_starts[slot], s.host_ranks[slot] = rank, start, rank


def own_rows(layer: BaseLayerWithLoRA) -> RankPool:
    """The layer's rank pool as a table of its own: the oracle allocates layer by layer, where the
    adapter weight pool shares one table between layers that every write treats alike."""
    s = layer.slots
    if not getattr(s, "oracle_owns_rows", False):
        s.rows, s.oracle_owns_rows = s.rows.copy(), True
    return s.rows


def clear_layer(layer: BaseLayerWithLoRA, slot: int) -> None:
    s = layer.slots
    own_rows(layer).free(slot)
    if s.host_ranks[slot]:
        s.host_ranks[slot] = 0
        s.scales[slot].zero_()
        s.ranks[slot] = 0


def write_adapter(layers: Mapping[str, BaseLayerWithLoRA], slot: int, modules: Mapping[str, LoRAModuleWeights]) -> None:
    """An adapter's ``modules`` into ``slot`` of every layer, one layer at a time."""
    for layer in layers.values():
        write_layer(layer, slot, [modules.get(name) for name in layer.slice_names])


def state(layers: Mapping[str, BaseLayerWithLoRA]) -> dict[str, list]:
    """Every layer's buffers (copies) and rows owned, to compare two models' pools."""
    return {name: [t.clone() for t in layer.slots.buffers()] + [sorted(layer.slots.rows._owned.items()),
                                                                 list(layer.slots.host_ranks)]
            for name, layer in layers.items()}


def assert_same_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in got:
        for mine, theirs in zip(got[name], expected[name]):
            same = torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs
            assert same, name
