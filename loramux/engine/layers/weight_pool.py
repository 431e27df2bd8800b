"""`AdapterWeightPool`: the GPU memory of a model's adapters, and the one way adapters get into it.

The pool gives every wrapped layer its `LayerSlots` (rank-pooled rows, one block per output
slice), sized together by bytes: ``LoRAConfig.max_gpu_lora_bytes`` (default
`default_gpu_lora_bytes`), every layer the same number of rows, shared by rank. Its slot count
(the per-slot buffers, the kernels' slot vector) follows from what the rows can hold: one slot
per `POOL_ROW_ALIGN` rows (the smallest adapter's), at most `MAX_LORA_SLOTS`, so no count binds
before the bytes do. An explicit ``max_loras`` caps the slots instead; with it and no byte
budget each slot is a fixed region of ``max_lora_rank`` rows in every layer (no sharing, no
fragmentation).

It works out an adapter's write once, ahead and off the engine's thread where it can (`prepare`:
`loramux.engine.layers.write_plan`), writes it into a slot of every layer at once (`write`: rows,
then `loramux.engine.layers.slot_copy` runs it), clears a slot (`clear`), answers
whether an adapter's rows fit (`footprint`, `fits`, `fits_keeping`), and splits an adapter for
the ranks of a tensor-parallel model (`shard`). Which adapter sits in which slot, and which to
evict, is the model manager's (`loramux.engine.adapters.lora_model`, `placement`); the pool holds
no adapter, only their weights and the writes it worked out for adapters whose weights live.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from loramux.engine.adapters.rank_pool import RowGroups
from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.layer_slots import LayerSlots
from loramux.engine.layers.slot_copy import SlotImage, copy_one_by_one, launch_table, zero_all
from loramux.engine.layers.write_plan import WritePlanner
from loramux.kernels.pool import POOL_ROW_ALIGN, pool_rows
from loramux.registry import LoRAConfig, LoRAModuleWeights

__all__ = ["AdapterWeightPool", "Footprint", "MAX_LORA_SLOTS", "default_gpu_lora_bytes"]

#: The default budget on CUDA: this share of the device's memory, as the CPU tier takes 10% of the
#: host's. Taken before the KV cache is sized (the blocks get what ``gpu_memory_utilization``
#: leaves after it). On an 80 GB GPU with Llama-3.1-8B (a rank row over its 130 wrapped layers
#: is 5.8 MB) it holds about 90 adapters of rank 16, q/v-only or on every projection alike:
#: every wrapped layer keeps the same number of rows.
GPU_LORA_BYTES_FRACTION = 0.10
#: ... and on a CPU: the embedded 135M model in float32 (a rank row is 1.6 MB) then holds ten
#: rank-8 adapters on every layer, a step on a CPU runs few more
CPU_LORA_BYTES = 128 << 20
#: Slots when ``max_loras`` is not set: the most adapters resident at once. A step holds at most
#: ``max_num_seqs`` of them; the rest stay as a cache. The kernels' slot vector and a CUDA graph's
#: step metadata grow with it (not their grids: those follow the step's tokens).
MAX_LORA_SLOTS = 256


def default_gpu_lora_bytes(device: torch.device) -> int:
    """The adapter pool's default budget on ``device``: `GPU_LORA_BYTES_FRACTION` of a CUDA
    device's memory, `CPU_LORA_BYTES` elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * GPU_LORA_BYTES_FRACTION)
    return CPU_LORA_BYTES


@dataclass(frozen=True)
class Footprint:
    """The pool rows an adapter takes in each wrapped layer: its largest rank there rounded up
    to `POOL_ROW_ALIGN`, 0 where it has no module (in the pool's layer order)."""

    rows: np.ndarray
    #: whether a layer it touches runs its LoRA beside a big base GEMM (`BaseLayerWithLoRA.big_gemm`)
    big_gemm: bool


class _Prepared(NamedTuple):
    """An adapter's `SlotImage` and `Footprint`, and (weakly) the weights they were worked out from."""

    weights: tuple[weakref.ref, ...]
    image: SlotImage
    footprint: Footprint


class AdapterWeightPool:
    """The adapter weights of ``layers`` (see the module docstring); not thread-safe on its own
    (the model manager serialises calls), but for `prepare`, which any thread may call.

    :param layers: the wrapped layers by module name (`patch_model`'s result); each gets its
        `LayerSlots` as ``layer.slots``.
    :param lora_config: ``max_loras``, ``max_lora_rank`` and ``max_gpu_lora_bytes``.
    :param use_table: run writes as one `copy_blocks` table; default: on CUDA.
    :raises ValueError: ``max_gpu_lora_bytes`` holds no adapter of ``max_lora_rank``.
    """

    def __init__(self, layers: Mapping[str, BaseLayerWithLoRA], lora_config: LoRAConfig, *,
                 use_table: bool | None = None) -> None:
        self.layers = dict(layers)
        self.lora_config = lora_config
        first = next(iter(self.layers.values()), None)
        self.device = first.lora_device if first is not None else torch.device("cpu")
        cap, R = lora_config.max_loras, lora_config.max_lora_rank
        budget = lora_config.max_gpu_lora_bytes
        if budget is None and cap is not None:  # one region of the largest rank per slot
            units, region = cap * pool_rows(R), pool_rows(R)
        else:  # every layer the same number of rows, shared by rank
            if budget is None:  # no more than MAX_LORA_SLOTS adapters of the largest rank can use
                most = MAX_LORA_SLOTS * pool_rows(R) * self.row_bytes
                budget = max(min(default_gpu_lora_bytes(self.device), most), pool_rows(R) * self.row_bytes)
            units, region = self._units_in(budget), None
        #: slots: adapters resident at once (the per-slot buffers' length)
        self.num_slots = cap if cap is not None else max(1, min(units // POOL_ROW_ALIGN, MAX_LORA_SLOTS))
        for layer in self.layers.values():
            layer.slots = LayerSlots(num_slots=self.num_slots, max_lora_rank=R, in_features=layer.in_features,
                                     output_sizes=layer.output_sizes, units=units,
                                     dtype=layer.lora_dtype, device=layer.lora_device)
        #: which slot owns which rows of every layer's pool
        self.rows = RowGroups([layer.slots for layer in self.layers.values()], units, region)
        self._planner = WritePlanner(list(self.layers.values()), self.rows)
        self._big_gemm = np.array([layer.big_gemm for layer in self.layers.values()], dtype=bool)
        #: the tensor-parallel rank of these layers' shards (None: not sharded): `write` takes
        #: that rank's part of an adapter (`shard`)
        self.tp_rank = next((layer.tp_shard.rank for layer in self.layers.values() if layer.tp_shard), None)
        self.use_table = self.device.type == "cuda" if use_table is None else use_table
        # slot -> the layers (indices into the planner's) where it has a rank: a clear zeroes
        # those, not every layer (the engine's thread clears a slot per eviction)
        self._holding: dict[int, list[int]] = {}
        # id of an adapter's first module weights -> what `prepare` worked out for its modules,
        # dropped as those weights are (an image holds the weights' tensors)
        self._prepared: dict[int, _Prepared] = {}

    @property
    def row_bytes(self) -> int:
        """Bytes of one rank row in every layer's pool together."""
        return sum(LayerSlots.row_bytes(layer.in_features, layer.output_sizes, layer.lora_dtype)
                   for layer in self.layers.values())

    def _units_in(self, budget: int) -> int:
        row_bytes = self.row_bytes
        rank = self.lora_config.max_lora_rank
        if row_bytes and budget // row_bytes < pool_rows(rank):
            raise ValueError(
                f"LoRAConfig.max_gpu_lora_bytes: got {budget}; allowed: at least {pool_rows(rank) * row_bytes} "
                f"(one adapter of max_lora_rank={rank} on every wrapped layer of this model takes "
                f"{pool_rows(rank) * row_bytes} bytes)")
        return budget // row_bytes if row_bytes else 0

    @property
    def units(self) -> int:
        """Rank rows in each layer's pool (0 without layers)."""
        return self.rows.units if self.layers else 0

    @property
    def capacity_bytes(self) -> int:
        """Bytes of GPU memory the pools take: the GPU tier's budget."""
        return sum(layer.slots.nbytes for layer in self.layers.values())

    @property
    def rows_usage(self) -> float:
        """The fullest layer's share of its pool rows in use, 0 to 1 (0 without layers)."""
        return max(((pool.units - pool.free_units) / pool.units for pool in self.rows.pools if pool.units),
                   default=0.0)

    # -- room ----------------------------------------------------------------------------------

    def prepare(self, modules: Mapping[str, LoRAModuleWeights]) -> tuple[SlotImage, Footprint]:
        """The write of an adapter with these modules but its slot and rows (`WritePlanner.image`),
        and its footprint: worked out once for the modules' weights (an adapter's never change)
        and kept while they live. Reads only the adapter and the layers' shapes, so any thread
        may call it: the engine does as a load is validated, so that placing the adapter later
        costs the engine's thread only its rows and its launch."""
        values = modules.values()
        first = next(iter(values), None)
        found = self._prepared.get(id(first))
        if found is not None and len(found.weights) == len(modules) and all(
                ref() is weights for ref, weights in zip(found.weights, values)):
            return found.image, found.footprint
        image = self._planner.image(modules)
        footprint = Footprint(image.rows, bool(self._big_gemm[image.rows > 0].any()))
        if first is not None:
            key, table = id(first), self._prepared

            def forget(ref: weakref.ref) -> None:  # the first weights are gone: so is the entry
                if (entry := table.get(key)) is not None and entry.weights[0] is ref:
                    del table[key]

            refs = (weakref.ref(first, forget), *map(weakref.ref, list(values)[1:]))
            table[key] = _Prepared(refs, image, footprint)
        return image, footprint

    def footprint(self, modules: Mapping[str, LoRAModuleWeights]) -> Footprint:
        """The pool rows an adapter with these modules takes in each layer (`prepare`)."""
        return self.prepare(modules)[1]

    def fits(self, footprint: Footprint) -> bool:
        """Whether every layer has ``footprint``'s rows free now."""
        return self.rows.fits(footprint.rows)

    def fits_keeping(self, footprint: Footprint, kept_slots: Collection[int]) -> bool:
        """Whether ``footprint`` would fit if only the adapters in ``kept_slots`` held rows."""
        return self.rows.fits_keeping(footprint.rows, kept_slots)

    # -- writing and clearing -----------------------------------------------------------------

    @torch.no_grad()
    def write(self, slot: int, modules: Mapping[str, LoRAModuleWeights]) -> None:
        """Write an adapter's ``modules`` into ``slot`` of every layer, on the current stream,
        in place of what the slot held; the layers it has no weights for are cleared there.
        Nothing blocks the host (copies from page-locked memory are asynchronous). ``modules``
        were validated against this model (`AdapterValidator`); on a tensor-parallel rank they
        are that rank's part (`shard`).

        :raises RuntimeError: a layer's pool has no room (make room first); the slot is empty then.
        """
        self.clear(slot)
        plan = self._planner.plan(slot, self.prepare(modules)[0])
        self._holding[slot] = plan.touched.tolist()
        if len(plan.touched):
            table = self._planner.table(plan) if self.use_table else None
            if table is not None:
                launch_table(table, self.device, stage=self.device.type == "cuda")
            else:
                copy_one_by_one(plan, self._planner.slots)

    def clear(self, slot: int) -> None:
        """Free ``slot``'s rows in every layer: tokens mapped to it get the base output. Its scales
        and ranks are zeroed in one `copy_blocks` table (without one: one call per dtype); the
        rows keep their contents, which no kernel reads at rank 0."""
        self.rows.free(slot)
        ranked = []  # the layers where it has a rank: elsewhere its scales and rank are zero already
        every = self._planner.slots
        for j in self._holding.pop(slot, ()):
            slots = every[j]
            if slots.host_ranks[slot]:
                slots.host_ranks[slot] = 0
                ranked.append(j)
        if not ranked:
            return
        if self.use_table:
            launch_table(self._planner.clear_table(slot, ranked), self.device, stage=self.device.type == "cuda")
        else:
            zero_all([cell for j in ranked for cell in (every[j].scales[slot], every[j].ranks[slot : slot + 1])])

    # -- tensor parallelism ---------------------------------------------------------------------

    def shard(self, modules: Mapping[str, LoRAModuleWeights], rank: int) -> dict[str, LoRAModuleWeights]:
        """Rank ``rank``'s part of a whole adapter's ``modules`` for these (sharded) layers, as
        views (S-LoRA's split): a column-parallel layer keeps A whole and its rows of B (per
        slice), a row-parallel one its columns of A and B whole; a layer that is not sharded
        keeps its module whole. Modules of no layer are left out."""
        parts = {}
        for name, weights in modules.items():
            found = self._planner.layer_of(name)
            if found is None:
                continue
            layer, index = found
            if weights.lora_a.dim() != 2 or weights.lora_b.dim() != 2:
                weights = layer.adapter_matrices(weights)
            shard = layer.tp_shard
            if shard is not None and shard.style == "column":
                size = layer.output_sizes[index]
                weights = replace(weights, lora_b=weights.lora_b[rank * size : (rank + 1) * size])
            elif shard is not None:
                n = layer.in_features
                weights = replace(weights, lora_a=weights.lora_a[:, rank * n : (rank + 1) * n])
            parts[name] = weights
        return parts
