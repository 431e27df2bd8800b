"""The checks a plugin's LoRA wrapper passes when its layer is wrapped, never on a first forward.

A wrapper from a third-party ``create_lora_layer`` is checked once, before it replaces its layer:
it must be a `BaseLayerWithLoRA` wrapping that layer (its constructor has refused a dtype the
kernels cannot compute in already), and a dry run on a tiny input (``example_input``) must hold:

- ``rows_shape`` counts the input's tokens, and ``base_output_spec`` says what the base layer
  returns (``torch.compile`` traces with it);
- with a random adapter in a one-slot pool (written the one way adapters are written) and a
  mapping of adapter and base tokens, every route the layer declares gives the same output, a
  standard delta equals ``scale * B(A(lora_input(x)))`` computed in float64 (a declared route
  its base layer does not allow, such as the GEMM onto the delta for a layer that scales its
  product, shows here), and a base token's output is the base layer's.

A kind of layer (its classes, sizes, dtype, device and routes) is run once per process. A failure
raises `LayerContractError`, whose message names the wrapper and whose ``fix`` says what to
change; `loramux.plugins.layers.layer_from_plugins` reports it naming the plugin and asks the next
plugin for the layer. The run uses the layer's device and kernels; the pool and the mapping it
makes are dropped afterwards.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from loramux.engine.layers import backend
from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.context import LoRAContext
from loramux.engine.layers.contract import Route
from loramux.engine.layers.weight_pool import AdapterWeightPool
from loramux.registry import LoRAConfig, LoRAModuleWeights

__all__ = ["LayerContractError", "check_wrapper"]

TOKENS = (0, -1, 0)  # the dry run's mapping: an adapter's token, a base token, the adapter's again
RANK = 2
#: what a wrapper read before the adapter weight pool held its weights, and where it is now
MOVED = {
    **dict.fromkeys(("lora_a_stacked", "lora_b_stacked"), "no per-slot copy is kept: the weights are rank-pooled"),
    "lora_a_pool": "self.slots.lora_a", "lora_b_pool": "self.slots.lora_b", "lora_pool_starts": "self.slots.pool_starts",
    "lora_scales": "self.slots.scales", "lora_ranks": "self.slots.ranks", "_host_ranks": "self.slots.host_ranks",
    "rank_pool": "self.slots.rows",
}


#: methods wrappers defined before the adapter weight pool wrote every layer: never called now
RETIRED = ("set_lora", "slot_write", "reset_lora", "reset_cells", "shard_lora")

_PASSED: set[tuple] = set()  # the kinds of layer whose dry run passed


class LayerContractError(ValueError):
    """A wrapper breaks the LoRA layer contract; ``fix`` says what to change."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.fix = fix


def check_wrapper(layer: nn.Module) -> None:
    """Check a plugin's wrapper (see the module docstring).

    :raises LayerContractError: it breaks the contract; the layer is as it was.
    """
    if not isinstance(layer, BaseLayerWithLoRA):
        raise LayerContractError(
            f"{type(layer).__name__} is not a loramux.engine.layers.BaseLayerWithLoRA, so it cannot hold adapters",
            fix="Subclass BaseLayerWithLoRA")
    retired = [name for name in RETIRED if hasattr(layer, name)]
    if retired:
        warnings.warn(
            f"{type(layer).__name__} defines {', '.join(retired)}, which loramux no longer calls: the adapter "
            "weight pool writes and clears every layer's slots (self.slots). Remove them; a delta of the "
            "wrapper's own goes in apply_lora with support=LayerSupport(..., own_delta=True) "
            "(docs/plugins.md, 'Upgrading a wrapper written for earlier versions').", stacklevel=2)
    # one dry run per kind of layer: a model has a few kinds, each in every decoder layer
    kind = (type(layer), type(layer.base_layer), layer.in_features, layer.output_sizes, layer.lora_dtype,
            layer.lora_device, layer.support)
    if kind in _PASSED:
        return
    saved = layer.slots, layer.lora_context
    try:
        with torch.no_grad():
            _dry_run(layer)
    finally:
        layer.slots, layer.lora_context = saved
    if len(_PASSED) >= 1024:
        _PASSED.clear()  # kinds of plugin layers come and go in tests; this only bounds the set
    _PASSED.add(kind)


def _dry_run(layer: BaseLayerWithLoRA) -> None:
    label = layer._label()
    x = _attempt(layer, lambda: layer.example_input(len(TOKENS)), "example_input",
                 f"Make example_input(num_tokens) return an input of num_tokens tokens that {label}'s base layer takes")
    base = _attempt(layer, lambda: layer.base_layer(x), "its base layer on example_input",
                    "Make example_input return what the base layer takes")
    rows = layer.rows_shape(x)
    if math.prod(rows) != len(TOKENS):
        raise LayerContractError(f"{label}: rows_shape gives {list(rows)} for example_input({len(TOKENS)}), "
                                 f"{list(x.shape)}: {math.prod(rows)} tokens",
                                 fix="Make rows_shape return the dims of the input that index its tokens")
    shape, dtype = layer.base_output_spec(x)
    if tuple(base.shape) != tuple(shape) or base.dtype != dtype:
        raise LayerContractError(f"{label}: base_output_spec says {dtype} {list(shape)}, but the base layer "
                                 f"returns {base.dtype} {list(base.shape)} for {list(x.shape)}",
                                 fix="Redefine base_output_spec (and rows_shape) to say what the base layer returns")
    weights = _random_adapter(layer)
    pool = AdapterWeightPool({layer.module_name: layer}, LoRAConfig(max_loras=1, max_lora_rank=layer.max_lora_rank))
    pool.write(0, dict(zip(layer.slice_names, weights)))
    layer.lora_context = LoRAContext(1)
    layer.lora_context.set(torch.tensor(TOKENS, dtype=torch.int32, device=layer.lora_device))
    meta = layer.lora_context.meta
    outputs = {route: _attempt(layer, lambda r=route: _run(layer, r, x, meta), f"route {route.name}",
                               "Declare in LayerSupport only the routes the layer allows (docs/plugins.md)")
               for route in layer.support.routes if _runs_here(layer, route, x)}
    base_rows = base.reshape(-1, layer.out_features) if Route.BASE_THEN_DELTA in outputs else None
    if layer.support.own_delta:
        got = outputs[Route.BASE_THEN_DELTA].reshape(-1, layer.out_features)
        if not torch.equal(got[1], base_rows[1]) or torch.equal(got[0], base_rows[0]):
            raise LayerContractError(f"{label}: its own apply_lora changed a base token's output, or not the "
                                     "adapter's", fix="Add the delta into y's rows of tokens whose slot holds an adapter only")
        return
    rows_x = layer.lora_input(x).double()  # [T, in]
    delta = torch.cat([(rows_x @ w.lora_a.double().T @ w.lora_b.double().T) * w.scaling for w in weights], dim=-1)
    delta = delta * layer.scale_multiplier() * torch.tensor([1.0 if slot >= 0 else 0.0 for slot in TOKENS],
                                                             dtype=torch.float64, device=delta.device)[:, None]
    expected = base.double() + layer.delta_as_output(delta.view(*rows, layer.out_features))
    tolerance = 1e-3 if layer.lora_dtype in (torch.float32, torch.float64) else 5e-2
    for route, got in outputs.items():
        error = (got.double() - expected).norm() / (expected - base.double()).norm()
        if not error <= tolerance:
            raise LayerContractError(
                f"{label}: route {route.name} gives another output than base_layer(x) + scale * B(A(lora_input(x))) "
                f"(relative error {float(error):.2g})",
                fix="Declare LayerSupport(own_delta=True) if apply_lora adds another delta; BASE_THEN_DELTA only for "
                    "an output whose rows are its tokens, DELTA_THEN_GEMM only where base_layer(x) is x @ weight.T; "
                    "and check lora_input, delta_as_output and scale_multiplier")


def _runs_here(layer: BaseLayerWithLoRA, route: Route, x: torch.Tensor) -> bool:
    """Whether ``route`` can run on this input: the GEMM onto the delta needs one dtype throughout."""
    weight = getattr(layer.base_layer, "weight", None)
    return route is not Route.DELTA_THEN_GEMM or (
        isinstance(weight, torch.Tensor) and x.dtype == weight.dtype == layer.lora_dtype)


def _run(layer: BaseLayerWithLoRA, route: Route, x: torch.Tensor, meta) -> torch.Tensor:
    if route in backend.APART_ROUTES:
        output, delta = backend.run_apart(layer, x, layer.base_inputs(x))
        return output + layer.delta_as_output(delta)
    return backend.ROUTE_BODIES[route](layer, x, meta)


def _random_adapter(layer: BaseLayerWithLoRA) -> list[LoRAModuleWeights]:
    generator = torch.Generator().manual_seed(0)
    rank = min(RANK, layer.max_lora_rank)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator, dtype=torch.float64) / math.sqrt(cols)).to(layer.lora_dtype)

    return [LoRAModuleWeights(matrix(rank, layer.in_features), matrix(size, rank), 0.5 + i, layer.is_embedding)
            for i, size in enumerate(layer.output_sizes)]


def _attempt(layer: BaseLayerWithLoRA, run, what: str, fix: str):
    try:
        return run()
    except LayerContractError:
        raise
    except Exception as error:
        moved = MOVED.get(getattr(error, "name", None)) if isinstance(error, AttributeError) else None
        if moved is not None:
            fix = (f"{error.name} is gone ({moved}): read the layer's LayerSlots, self.slots (docs/plugins.md, "
                   "'Upgrading a wrapper written for earlier versions')")
        raise LayerContractError(f"{layer._label()}: {what} failed: {type(error).__name__}: {error}", fix=fix) from error
