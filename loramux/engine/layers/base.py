"""`BaseLayerWithLoRA`: the contract every LoRA layer wrapper follows, built-in or from a plugin.

A wrapper keeps the model's own layer as ``base_layer`` and declares the width of its LoRA input,
its output slices, the dtype of its adapter weights and, in ``support``, the forward routes its
base layer allows. The adapter weight pool (`loramux.engine.layers.weight_pool`) gives it its
`LayerSlots` and writes them; the kernel backend (`loramux.engine.layers.backend`) runs its
forward. Methods marked *hook* are what a subclass may redefine (docs/plugins.md: the contract).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loramux.engine.layers import backend
from loramux.engine.layers.contract import LayerSupport, Route
from loramux.engine.layers.layer_slots import LayerSlots
from loramux.engine.layers.lora_op import register_layer
from loramux.engine.layers.side_stream import is_big_gemm
from loramux.kernels import LoRABatchMeta
from loramux.registry import LoRAConfig, LoRAModuleWeights

__all__ = ["BaseLayerWithLoRA", "SLOT_DTYPES"]

#: the dtypes adapter weights may be kept in (the kernels compute in them)
SLOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class BaseLayerWithLoRA(nn.Module):
    """A layer wrapped for multi-LoRA: ``base_layer(x) + scale[slot] * B[slot](A[slot](x))``.

    :param base_layer: the layer to wrap; its parameters are used as they are, never copied.
    :param module_name: its name in the model (``model.layers.0.self_attn.q_proj``).
    :param lora_config: ``max_loras`` and ``max_lora_rank`` size the slots.
    :param in_features: width of the LoRA input, ``lora_input(x)``'s rows (an embedding: the
        vocabulary size; a convolution: its input channels times its kernel size).
    :param output_sizes: width of each output slice; one slice unless adapters bring one A/B
        pair per slice (a fused layer serving adapters trained on its unfused parts).
    :param slice_names: the adapter module name whose weights fill each slice; defaults to
        ``(module_name,)``.
    :param dtype: the dtype of the adapter weights, which is the dtype the kernels compute the
        delta in: the layer's input activations' (float16, bfloat16, float32 or float64).
        Defaults to the base layer's weight dtype, so a layer whose weight is not floating
        point (int8, float8) must pass it.
    :param device: defaults to the base layer's weight device.
    :param support: the routes this layer allows; defaults to the class's ``support``.
    :raises TypeError: no usable ``dtype`` (the message names the fix).
    :raises ValueError: slice names and sizes disagree.
    """

    #: PEFT stores an embedding LoRA as ``lora_embedding_A/B``; the loader marks those.
    is_embedding = False
    #: The routes a layer of this class allows (an instance may narrow them: ``support=``). The
    #: default, the base layer then ``apply_lora``, serves any layer whose output is rows.
    support = LayerSupport()

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
        support: LayerSupport | None = None,
    ) -> None:
        super().__init__()
        # a tensor-parallel shard (`loramux.engine.tensor_parallel.sharding.ShardSpec`): the sizes
        # above are this rank's; adapters come whole and the weight pool splits them
        self.tp_shard = getattr(base_layer, "loramux_tp", None)
        self.base_layer = base_layer
        self.module_name = module_name
        self.in_features = int(in_features)
        self.output_sizes = tuple(int(size) for size in output_sizes)
        self.out_features = sum(self.output_sizes)
        self.n_slices = len(self.output_sizes)
        self.slice_names = tuple(slice_names) if slice_names is not None else (module_name,)
        if len(self.slice_names) != self.n_slices or min(self.output_sizes, default=0) < 1 or self.in_features < 1:
            raise ValueError(f"{self._label()}: {len(self.slice_names)} slice names for output sizes {list(self.output_sizes)}"
                             f" and in_features={self.in_features}; give one name per slice, every size at least 1")
        self.max_loras, self.max_lora_rank = lora_config.max_loras, lora_config.max_lora_rank
        if support is not None:
            self.support = support
        weight = getattr(base_layer, "weight", None)
        self._dtype = self._slot_dtype(dtype, weight)
        self._device = device or (weight.device if isinstance(weight, torch.Tensor) else None)
        self.slots: LayerSlots | None = None  # given by the adapter weight pool
        self.lora_context = None  # the model's `LoRAContext`, set by patch_model
        self._computes_logits = False
        self.layer_id = register_layer(self)  # how the lora ops find this layer
        # a big GEMM runs alone in a step graph for adapters that leave such layers alone
        self.big_gemm = is_big_gemm(self.in_features * self.out_features)
        self.refresh_routes()

    def _label(self) -> str:
        return f"{type(self).__name__}({self.module_name!r})"

    def _slot_dtype(self, dtype: torch.dtype | None, weight) -> torch.dtype:
        chosen = dtype or (weight.dtype if isinstance(weight, torch.Tensor) else torch.get_default_dtype())
        if chosen not in SLOT_DTYPES:
            given = f"dtype={dtype}" if dtype is not None else f"its base layer's weight is {chosen}, and no dtype= was given"
            raise TypeError(
                f"{self._label()}: {given}, but adapter weights are kept in the dtype the kernels compute "
                f"the delta in, one of {', '.join(map(str, SLOT_DTYPES))}; pass dtype= to "
                "BaseLayerWithLoRA.__init__: the dtype of the layer's input activations (torch.bfloat16, say)")
        return chosen

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

    @property
    def lora_dtype(self) -> torch.dtype:
        """The dtype adapter weights are stored in (the kernels compute in it)."""
        return self.slots.dtype if self.slots is not None else self._dtype

    @property
    def lora_device(self) -> torch.device:
        return self.slots.lora_a.device if self.slots is not None else torch.device(self._device or "cpu")

    @property
    def computes_logits(self) -> bool:
        """Whether this is the model's LM head (set by patch_model): its rows are the logits'."""
        return self._computes_logits

    @computes_logits.setter
    def computes_logits(self, value: bool) -> None:
        self._computes_logits = bool(value)
        self.refresh_routes()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.refresh_routes()  # a move changes where the delta may run
        return self

    def refresh_routes(self) -> None:
        """Read this layer's `RoutePlan` from the backend's table again (its forward follows it)."""
        self.route_plan = backend.plan_routes(backend.layer_facts(self))

    def extra_repr(self) -> str:
        return (f"module_name={self.module_name!r}, in={self.in_features}, out={self.output_sizes}, "
                f"max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}")

    # -- hooks ----------------------------------------------------------------------------------

    def rows_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """*Hook.* The dims of ``x`` that index tokens, in the model's token order (default: all
        but the last, the features)."""
        return tuple(x.shape[:-1])

    def base_output_spec(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        """*Hook.* Shape and dtype of ``base_layer(x)``, which ``torch.compile`` needs before the
        layer runs: ``rows_shape(x) + (out_features,)``, in x's dtype, or autocast's when it is on
        (a projection is a matmul). Checked against ``base_layer(x)`` when a plugin's layer is
        wrapped, and at every forward."""
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        return (*self.rows_shape(x), self.out_features), dtype

    def base_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """*Hook.* What the base layer computes from ``x`` first, computed in traced code before
        the LoRA op, so a compiled layer fuses it into the kernel that made x, and handed to
        `run_base` inside the op (default: nothing; an FP8 base: its quantized activations)."""
        return []

    def run_base(self, x: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        """*Hook.* ``base_layer(x)``, given ``inputs = base_inputs(x)``."""
        return self.base_layer(x)

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """*Hook.* ``x`` as the rows ``[T, in_features]`` the shrink reads, in the slot dtype."""
        return x.reshape(-1, self.in_features).to(self.lora_dtype)

    def delta_as_output(self, delta: torch.Tensor) -> torch.Tensor:
        """*Hook.* The delta ``[*rows_shape(x), out_features]`` in the base output's layout (a
        view), for the routes that add it apart (`Route.DELTA_APART`)."""
        return delta

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor, meta: LoRABatchMeta) -> None:
        """*Hook.* ``y [T, out_features] += delta`` in place (y: the base output's rows, in the
        slot dtype): the standard shrink and expand of ``lora_input(x)``. A layer that adds
        another delta redefines it and declares ``LayerSupport(own_delta=True)``."""
        backend.add_standard_delta(self, x, y, meta)

    def scale_multiplier(self) -> float:
        """*Hook.* A factor every adapter's delta is multiplied by, beside its scaling, because
        the base layer multiplies its output by it after the LoRA delta would be added in the
        trained model (PEFT scales Gemma's embedding delta by ``embed_scale``). It is not the
        layer's own output scale: a quantized layer's weight scale belongs in its forward, and
        its delta is not scaled by it (1 for nearly every layer)."""
        return 1.0

    def adapter_matrices(self, weights: LoRAModuleWeights) -> LoRAModuleWeights:
        """*Hook.* Weights whose A or B is not 2-D as matrices, A ``[r, in_features]`` and B
        ``[out, r]`` (views): asked for such weights only, when an adapter is validated and when
        it is written. PEFT saves a convolution's A as ``[r, in, *kernel]`` and B as
        ``[out, r, 1, ...]``; a 1x1 convolution's wrapper returns them flattened.

        :raises ValueError: this layer takes matrices only (the default).
        """
        raise ValueError(
            f"{self._label()}: the adapter's A is {list(weights.lora_a.shape)} and B "
            f"{list(weights.lora_b.shape)}, not matrices, and this layer maps no other layout "
            "(a layer plugin maps one by redefining BaseLayerWithLoRA.adapter_matrices)")

    def example_input(self, num_tokens: int) -> torch.Tensor:
        """*Hook.* An input of ``num_tokens`` tokens, for the check run when a plugin's layer is
        wrapped (default: ``[num_tokens, in_features]`` activations in the slot dtype)."""
        x = torch.randn(num_tokens, self.in_features, generator=torch.Generator().manual_seed(0))
        return x.to(self.lora_device, self.lora_dtype)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base_layer(x)`` plus each token's delta, by the route `ROUTES` gives this step (the
        base layer alone until the model manager gives the layer its `LoRAContext` and slots)."""
        context, plan = self.lora_context, self.route_plan
        if context is None or self.slots is None:
            return self.base_layer(x)
        # the context's phase flags are read only where this layer's route depends on them, so
        # a compiled layer guards on no flag it ignores (each flag's values: a variant each)
        route = plan.eager
        if plan.graph is not route and context.beside:
            route = plan.graph
        if plan.small_gemm_graph is not plan.graph and context.skip_big:
            route = plan.small_gemm_graph
        if route is Route.BASE:
            return self.base_layer(x)
        shape, dtype = self.base_output_spec(x)
        if route in backend.APART_ROUTES:
            # the sum is traced, so a compiled layer folds it into the pointwise kernel that reads
            # the output next (no launch of its own)
            delta_shape = (*self.rows_shape(x), self.out_features)
            output, delta = torch.ops.loramux.lora_delta(x, self.base_inputs(x), self.layer_id, shape, dtype,
                                                         delta_shape, self.lora_dtype)
            delta = self.delta_as_output(delta)
            return output + delta if delta.dtype == dtype else (output + delta).to(dtype)
        # one opaque op for the whole layer: torch.compile traces no per-step Python state
        return torch.ops.loramux.lora_layer(x, self.layer_id, shape, dtype)
