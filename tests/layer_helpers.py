"""Helpers for tests of one wrapped layer on its own: a one-layer adapter weight pool, writes into
it checked as the model manager's validator checks adapters, and the in-order routes forced."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from loramux.engine.layers import BaseLayerWithLoRA, Route
from loramux.engine.layers.weight_pool import AdapterWeightPool
from loramux.engine.adapters.lora_validation import describe_mismatch
from loramux.registry import LoRAConfig, LoRAModuleWeights

_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_of(layer: BaseLayerWithLoRA, config: LoRAConfig | None = None) -> AdapterWeightPool:
    """``layer``'s own adapter weight pool, made on first use (``config``: its sizes; default
    the layer's ``max_loras`` regions of ``max_lora_rank`` rows)."""
    pool = _POOLS.get(layer)
    if pool is None:
        config = config or LoRAConfig(max_loras=layer.max_loras, max_lora_rank=layer.max_lora_rank)
        pool = _POOLS[layer] = AdapterWeightPool({layer.module_name: layer}, config)
    return pool


def set_lora(layer: BaseLayerWithLoRA, slot: int, weights_by_slice: Sequence[LoRAModuleWeights | None]) -> None:
    """Write one entry per output slice (None: left out) into ``slot`` of ``layer``'s pool.

    :raises ValueError: the weights do not fit the layer (nothing is written).
    """
    problem = describe_mismatch(layer, weights_by_slice)
    if problem is not None:
        raise ValueError(problem)
    pool_of(layer).write(slot, {name: w for name, w in zip(layer.slice_names, weights_by_slice) if w is not None})


def reset_lora(layer: BaseLayerWithLoRA, slot: int) -> None:
    pool_of(layer).clear(slot)


@contextmanager
def in_order(*layers: BaseLayerWithLoRA) -> Iterator[None]:
    """The layers add their delta after the base layer in step graphs too (no side stream)."""
    saved = [layer.route_plan for layer in layers]
    for layer, plan in zip(layers, saved):
        layer.route_plan = plan._replace(**{phase: Route.BASE_THEN_DELTA for phase in ("graph", "small_gemm_graph")
                                            if getattr(plan, phase) is Route.DELTA_BESIDE})
    try:
        yield
    finally:
        for layer, plan in zip(layers, saved):
            layer.route_plan = plan
