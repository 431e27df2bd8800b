"""The kernel backend: every forward route of a wrapped layer, and the one table that picks it.

A wrapped layer's forward is ``base_layer(x)`` plus, for every token, the delta of its slot's
adapter (``scale * B(A(x))``). How the two are computed (`Route`) depends on what the layer
declares (`LayerSupport`), on the step (a step graph's static mapping, or an eager step's exact
one) and on its batch; `ROUTES` lists every route with when it runs, and `plan_routes` reads it
once per layer (when it is built, moved, or made the LM head) into the `RoutePlan` its forward
follows. The routes' bodies are below; the layer's traced ``forward`` calls them through two
custom ops (`loramux.engine.layers.lora_op`): ``loramux::lora_delta`` for the routes that return
the delta apart (`APART_ROUTES`), ``loramux::lora_layer`` for the others.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch

from loramux.engine.layers import side_stream
from loramux.engine.layers.contract import LayerSupport, Route
from loramux.engine.layers.side_stream import beside_streams, gemm_carveout, lora_sms_beside
from loramux.kernels import LoRABatchMeta, lora_apply, lora_expand, lora_shrink
from loramux.kernels.fp8_reference import FP8_DTYPE
from loramux.kernels.tiles import DECODE_MAX_TOKENS

__all__ = ["APART_ROUTES", "Batch", "Phase", "ROUTES", "RoutePlan", "Rule", "add_standard_delta", "plan_routes",
           "run_apart", "run_in_order"]


class Phase(enum.Enum):
    GRAPH = "a step graph's static mapping"
    SMALL_GEMM_GRAPH = "a step graph for adapters that leave every big-GEMM layer alone"
    EAGER = "an eager step's exact mapping"


class Batch(enum.Enum):
    NO_DELTA = "no token uses an adapter that touches the layer (known in eager steps only)"
    DECODE = f"at most {DECODE_MAX_TOKENS} tokens, or activations in another dtype than the slots'"
    PREFILL = f"more than {DECODE_MAX_TOKENS} tokens, activations and slots in one dtype, no autocast"


class Facts(NamedTuple):
    """What the table asks of a layer: its declaration and where it runs."""

    support: LayerSupport
    big_gemm: bool  # in_features * out_features reaches `side_stream.BIG_GEMM_WEIGHTS`
    forks: bool  # its device runs the delta on a side stream (`side_stream.delta_beside_base`)
    logits: bool  # the model's LM head (nothing after it would fold an added delta)
    gemm_dtype: bool  # the base weight is in the slots' dtype (an addmm onto the delta needs it)


@dataclass(frozen=True)
class Rule:
    route: Route
    phases: tuple[Phase, ...]
    batches: tuple[Batch, ...]
    layer: Callable[[Facts], bool]


ALL_PHASES, GRAPHS = tuple(Phase), (Phase.GRAPH, Phase.SMALL_GEMM_GRAPH)
ANY_BATCH = tuple(Batch)

#: Every forward route, with when it runs: the first rule whose phase, batch and layer condition
#: hold. A step graph reads one static mapping whatever its adapters, so its phases know no batch.
ROUTES: tuple[Rule, ...] = (
    # a graph for adapters that leave the big GEMMs alone (q/v adapters): those layers run alone
    Rule(Route.BASE, (Phase.SMALL_GEMM_GRAPH,), ANY_BATCH, lambda f: f.big_gemm),
    # nothing to add: a CUDA graph captured without adapters holds no LoRA kernel either
    Rule(Route.BASE, (Phase.EAGER,), (Batch.NO_DELTA,), lambda f: True),
    # decode in a graph: the delta's latency-bound launches hidden beside the base GEMM; not the
    # LM head, which runs outside the compiled layers (its sum would be a launch of its own)
    Rule(Route.DELTA_BESIDE, GRAPHS, ANY_BATCH,
         lambda f: f.support.allows(Route.DELTA_BESIDE) and f.forks and not f.logits),
    # a prefill: the GEMM is compute-bound, and reading the delta in its epilogue saves a pass
    Rule(Route.DELTA_THEN_GEMM, (Phase.EAGER,), (Batch.PREFILL,),
         lambda f: f.support.allows(Route.DELTA_THEN_GEMM) and f.gemm_dtype),
    # in order: the delta added into the base output's rows (an eager step's exact mapping can
    # leave a layer alone, where a delta buffer of its own would be zeros written and read)
    Rule(Route.BASE_THEN_DELTA, ALL_PHASES, ANY_BATCH, lambda f: f.support.allows(Route.BASE_THEN_DELTA)),
    Rule(Route.DELTA_APART, ALL_PHASES, ANY_BATCH, lambda f: f.support.allows(Route.DELTA_APART)),
)

#: the routes ``loramux::lora_delta`` runs (the delta returned apart); ``loramux::lora_layer`` runs the others
APART_ROUTES = frozenset({Route.DELTA_APART, Route.DELTA_BESIDE})


class RoutePlan(NamedTuple):
    """One layer's routes, read from `ROUTES`: what its forward follows."""

    graph: Route
    small_gemm_graph: Route
    eager: Route  # an eager decode (a batch of `Batch.DECODE`)
    eager_prefill: Route
    eager_no_delta: Route


def choose(facts: Facts, phase: Phase, batch: Batch) -> Route:
    """The route `ROUTES` gives a layer of these facts, in this phase, for this batch."""
    for rule in ROUTES:
        if phase in rule.phases and batch in rule.batches and rule.layer(facts):
            return rule.route
    raise AssertionError(f"no route for {facts} in {phase}, {batch}: LayerSupport guarantees one")


def plan_routes(facts: Facts) -> RoutePlan:
    """A layer's `RoutePlan`. Each phase's routes with a delta run in one op (both apart, or
    neither), since the traced forward picks the op before the batch is known."""
    plan = RoutePlan(choose(facts, Phase.GRAPH, Batch.DECODE), choose(facts, Phase.SMALL_GEMM_GRAPH, Batch.DECODE),
                     choose(facts, Phase.EAGER, Batch.DECODE), choose(facts, Phase.EAGER, Batch.PREFILL),
                     choose(facts, Phase.EAGER, Batch.NO_DELTA))
    assert (plan.eager in APART_ROUTES) == (plan.eager_prefill in APART_ROUTES), plan
    return plan


def layer_facts(layer) -> Facts:
    """The `Facts` of a `BaseLayerWithLoRA` as it is now."""
    weight = getattr(layer.base_layer, "weight", None)
    return Facts(layer.support, layer.big_gemm, side_stream.delta_beside_base(layer.lora_device), layer.computes_logits,
                 isinstance(weight, torch.Tensor) and weight.dtype == layer.lora_dtype)


# -- the routes ------------------------------------------------------------------------------------


def run_in_order(layer, x: torch.Tensor) -> torch.Tensor:
    """The body of ``loramux::lora_layer``: ``base_layer(x)`` plus the delta for the mapping the
    layer's `LoRAContext` holds now, in a new contiguous tensor."""
    meta = lora_meta(layer, x)
    return ROUTE_BODIES[_route(layer, x, meta)](layer, x, meta)


def _route(layer, x: torch.Tensor, meta: LoRABatchMeta | None) -> Route:
    plan = layer.route_plan
    if meta is None:
        return plan.eager_no_delta
    if meta.static:
        return plan.graph
    if plan.eager_prefill is not plan.eager and meta.num_tokens > DECODE_MAX_TOKENS and x.dtype == layer.lora_dtype \
            and not torch.is_autocast_enabled(x.device.type):
        return plan.eager_prefill
    return plan.eager


def base_only(layer, x: torch.Tensor, meta: LoRABatchMeta | None = None) -> torch.Tensor:
    return layer.base_layer(x).contiguous()


def base_then_delta(layer, x: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
    """`Route.BASE_THEN_DELTA`: the base output, then ``apply_lora`` adds into its rows."""
    output = layer.base_layer(x).contiguous()
    with rows_in_slot_dtype(layer, output) as y:
        layer.apply_lora(x, y, meta)
    return output


def delta_then_gemm(layer, x: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
    """`Route.DELTA_THEN_GEMM`: the shrink, the expand storing each row's delta into a buffer of
    its own (never read), then the base GEMM adding its product onto it (``addmm_``: cuBLAS reads
    it in the epilogue). Adding the delta after the GEMM instead reads and writes the output's
    targeted slices once more in a memory-bound kernel (at 8,192 tokens of Llama-3.1-8B's
    gate_up, 940 MB a layer), which is most of a prefill's LoRA time
    (docs/benchmarks/throughput.md, the prefill rows)."""
    x2d = layer.lora_input(x)
    slots = layer.slots
    delta = torch.empty(meta.num_tokens, layer.out_features, dtype=slots.dtype, device=x.device)
    if meta.num_lora_tokens < meta.num_tokens or not all(slots.host_ranks[s] for s in meta.active_slots_host):
        delta.zero_()  # the expand leaves rows of tokens without an adapter here as they are
    store_delta(layer, x2d, delta, meta)
    delta.addmm_(x2d, layer.base_layer.weight.t())
    return delta.view(*layer.rows_shape(x), layer.out_features)


def run_apart(layer, x: torch.Tensor, base_inputs: list[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of ``loramux::lora_delta``: ``(base_layer(x), delta)``, both contiguous, the delta
    ``[*rows_shape(x), out_features]`` in the slot dtype (`Route.DELTA_APART`); the base output
    is ``layer.run_base(x, base_inputs)``.

    `Route.DELTA_BESIDE` computes the delta on the side stream while the main stream runs the
    base GEMM, which leaves `lora_sms_beside` multiprocessors to it (`gemm_carveout`):

        main:  alloc buf, delta ─┬─ base GEMM (carveout) ─────────────────── wait(side) ─ return
        side:                    └─ wait(main) ─ zero delta ─ shrink ─ expand (store) ─┘

    The GEMM is enqueued before the delta's kernels (the side stream's wait comes before it, so
    the delta does not wait for it): enqueued after them, it ran slower beside them. Every fork
    is joined before the op returns, so a CUDA-graph capture gets a parallel branch that ends
    inside the layer. Without a side stream (the CPU, tests) the same kernels run in order.
    """
    meta = lora_meta(layer, x)
    rows = (*layer.rows_shape(x), layer.out_features)
    if meta is None:  # no token of this (eager) step uses an adapter touching this layer
        output = layer.run_base(x, base_inputs).contiguous()
        return output, torch.zeros(rows, dtype=layer.lora_dtype, device=output.device)
    T, device, slots = meta.num_tokens, x.device, layer.slots
    # made on the main stream, before the fork, so the main stream owns their memory
    buf = torch.empty(T, layer.n_slices * slots.max_lora_rank, dtype=torch.float32, device=device)  # [T, n*R]
    delta = torch.empty(T, layer.out_features, dtype=slots.dtype, device=device)  # [T, N]
    fork = (layer.route_plan.graph if meta.static else layer.route_plan.eager) is Route.DELTA_BESIDE
    streams = beside_streams(device) if fork else None
    sms = lora_sms_beside(T, device, layer.in_features * layer.out_features,
                          fp8=any(t.dtype == FP8_DTYPE for t in base_inputs)) if fork else None  # the GEMM reads FP8
    if streams is not None:
        main, side = streams
        side.wait_stream(main)  # x is made on the main stream (and not the GEMM, enqueued after this)
    # the GEMM first: enqueued after the delta it waited for the side stream's launches, and the
    # decode step is as slow as its GEMMs (docs/benchmarks/throughput.md, the decode rows)
    with gemm_carveout(sms or 0):
        output = layer.run_base(x, base_inputs).contiguous()  # on the main stream, beside the delta
    with torch.cuda.stream(side) if streams is not None else nullcontext():
        # what this allocates (x cast to the slot dtype, split-K scratch) is used on this stream only
        delta.zero_()  # rows of tokens without an adapter here stay zero
        store_delta(layer, layer.lora_input(x), delta, meta, buf=buf, sms=sms)
    if streams is not None:
        main.wait_stream(side)  # the join: delta is written, and x's memory is not reused before it is read
    return output, delta.view(rows)


ROUTE_BODIES: dict[Route, Callable] = {Route.BASE: base_only, Route.BASE_THEN_DELTA: base_then_delta,
                                       Route.DELTA_THEN_GEMM: delta_then_gemm}


# -- the standard delta ----------------------------------------------------------------------------


def store_delta(layer, x2d: torch.Tensor, delta: torch.Tensor, meta: LoRABatchMeta, *,
                buf: torch.Tensor | None = None, sms: int | None = None) -> None:
    """``delta [T, N]`` = each token's delta, in the rows of tokens whose adapter touches this
    layer (zeros in the slices it does not target; other rows left as they are): the shrink of
    ``x2d`` (into ``buf`` when given), then the expand in its store mode; launches sized for
    ``sms`` multiprocessors (None: all)."""
    s = layer.slots
    buf = lora_shrink(x2d, s.lora_a, s.scales, meta, s.ranks, out=buf, pool_starts=s.pool_starts,
                      max_rank=s.max_lora_rank, sms=sms)
    lora_expand(delta, buf, s.lora_b, layer.output_sizes, meta, s.ranks, pool_starts=s.pool_starts, sms=sms,
                store=True, scales=s.scales)


def add_standard_delta(layer, x: torch.Tensor, y: torch.Tensor, meta: LoRABatchMeta) -> None:
    """``y [T, out] += delta``, in place, for ``lora_input(x)``: the standard shrink and expand."""
    s = layer.slots
    lora_apply(y, layer.lora_input(x), s.lora_a, s.lora_b, s.scales, s.ranks, layer.output_sizes, meta,
               pool_starts=s.pool_starts, max_rank=s.max_lora_rank)


def lora_meta(layer, x: torch.Tensor) -> LoRABatchMeta | None:
    """The kernel metadata for input ``x``, or None when no token gets a delta from this layer."""
    rows, context = layer.rows_shape(x), layer.lora_context
    meta = context.logits_meta_for(rows) if layer.computes_logits else context.meta_for(rows)
    if meta is None:
        return None
    if not meta.static and not any(layer.slots.host_ranks[slot] for slot in meta.active_slots_host):
        return None  # no token of this batch uses an adapter that touches this layer
    return meta


@contextmanager
def rows_in_slot_dtype(layer, output: torch.Tensor) -> Iterator[torch.Tensor]:
    """``output`` as ``[T, out]`` rows for the kernels to add into: a view, or, when the slot
    dtype differs from the output's (autocast, a wrapper built with another ``dtype``), a copy
    in the slot dtype, written back on exit."""
    y = output.view(-1, layer.out_features)  # [T, out], shares memory with output
    if y.dtype == layer.lora_dtype:
        yield y
        return
    delta_y = y.to(layer.lora_dtype)
    yield delta_y
    y.copy_(delta_y)
