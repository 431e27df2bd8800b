"""What a LoRA layer wrapper declares: the routes its forward may take.

A wrapper (`loramux.engine.layers.base.BaseLayerWithLoRA`) states its sizes, its output slices and
the dtype of its adapter weights in its constructor, and in a `LayerSupport` which `Route` its
base layer allows. The kernel backend (`loramux.engine.layers.backend`) picks each forward's route
from that declaration (its table, `ROUTES`, says which runs when); nothing looks at which methods a
wrapper defines. No torch here: the declaration is plain data.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["IN_ORDER_ROUTES", "LayerSupport", "Route", "STANDARD_ROUTES"]


class Route(enum.Enum):
    """How one forward of a wrapped layer computes ``base_layer(x)`` plus each token's delta."""

    #: the base layer alone: no token of the step uses an adapter that touches the layer
    BASE = "base"
    #: the base layer, then the wrapper's ``apply_lora`` adds the delta into its output's rows
    BASE_THEN_DELTA = "base_then_delta"
    #: the base output and the standard delta apart (the shrink and expand of ``lora_input(x)``
    #: into a buffer of their own), summed by the wrapper's traced forward
    DELTA_APART = "delta_apart"
    #: `DELTA_APART` with the delta on a side CUDA stream, beside the base layer's GEMM
    DELTA_BESIDE = "delta_beside"
    #: the standard delta stored, then ``x @ base_layer.weight.T`` added onto it (one addmm)
    DELTA_THEN_GEMM = "delta_then_gemm"


#: routes that compute the standard delta themselves and never call ``apply_lora``
STANDARD_ROUTES = frozenset({Route.DELTA_APART, Route.DELTA_BESIDE, Route.DELTA_THEN_GEMM})
#: routes that run anywhere, in order (one of them serves every step the others do not)
IN_ORDER_ROUTES = frozenset({Route.BASE_THEN_DELTA, Route.DELTA_APART})


@dataclass(frozen=True, init=False)
class LayerSupport:
    """What a wrapped layer allows: the routes besides `Route.BASE` (which every layer takes), and
    whether its delta is its own.

    - `Route.BASE_THEN_DELTA`: its output is rows (``output.view(-1, out_features)``), into
      which ``apply_lora`` adds the delta.
    - `Route.DELTA_APART`: the standard delta may be computed apart and added by the traced
      forward (``delta_as_output`` maps its rows to the output's layout): for an output that is
      not rows, such as a convolution's ``[B, C, L]``.
    - `Route.DELTA_BESIDE`: the base layer is a GEMM long enough to hide the standard delta
      computed beside it on a side stream (in step graphs on CUDA).
    - `Route.DELTA_THEN_GEMM`: ``base_layer(x)`` is exactly ``x @ base_layer.weight.T`` (no bias,
      no scale, a floating-point weight ``[out, in]``), so a prefill may add that GEMM onto the
      stored delta. A quantized base layer never allows it.

    ``own_delta``: the layer's ``apply_lora`` adds another delta than the standard shrink and
    expand of ``lora_input(x)`` (the embedding's gather; a plugin's own kernels); it then allows
    `Route.BASE_THEN_DELTA` alone, the only route that calls ``apply_lora``.

    :raises ValueError: no route that runs in order (`IN_ORDER_ROUTES`), `Route.BASE` listed, or
        a route that computes the standard delta beside ``own_delta``.
    """

    routes: frozenset[Route]
    own_delta: bool

    def __init__(self, routes: Iterable[Route] = (Route.BASE_THEN_DELTA,), *, own_delta: bool = False) -> None:
        routes = frozenset(routes)
        if not all(isinstance(r, Route) for r in routes) or Route.BASE in routes or not routes & IN_ORDER_ROUTES:
            raise ValueError(
                f"LayerSupport(routes={sorted(str(r) for r in routes)}): list Route members besides BASE "
                f"(every layer takes it), with at least one of {sorted(str(r) for r in IN_ORDER_ROUTES)}")
        if own_delta and routes & STANDARD_ROUTES:
            raise ValueError(
                f"LayerSupport(own_delta=True) with {sorted(str(r) for r in routes & STANDARD_ROUTES)}: those "
                "routes compute the standard delta and never call apply_lora; allow Route.BASE_THEN_DELTA alone")
        object.__setattr__(self, "routes", routes)
        object.__setattr__(self, "own_delta", bool(own_delta))

    def allows(self, route: Route) -> bool:
        return route is Route.BASE or route in self.routes

    def without(self, *routes: Route) -> LayerSupport:
        """This declaration less ``routes`` (what a base layer of the wrapper's cannot take)."""
        return LayerSupport(self.routes - set(routes), own_delta=self.own_delta)
