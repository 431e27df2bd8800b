"""LoRA on projections: `nn.Linear` (every Llama/Qwen/Mistral/Gemma/Phi-3 projection, ``lm_head``)
and transformers' GPT-2 `Conv1D`.

Fused layers (Phi-3 ``qkv_proj`` / ``gate_up_proj``, GPT-2 ``c_attn``) need nothing special here:
PEFT trains and saves one A/B pair over the fused output, so they are one slice. The base class
takes several slices for plugins that serve per-part adapters on a fused layer.

``lm_head`` is a plain `LinearWithLoRA`: when the model computes logits on the last positions
only, `LoRAContext.meta_for` maps those rows to their slots. Tied embeddings stay tied: the
wrapper reads the base layer's weight, never a copy.
"""

from __future__ import annotations

import torch
from torch import nn

from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.contract import LayerSupport, Route
from loramux.engine.quantization.fp8 import Fp8Linear
from loramux.registry import LoRAConfig

__all__ = ["LinearWithLoRA", "Conv1DWithLoRA"]

#: a projection: the delta added after its GEMM or computed beside it on a side stream, and, when
#: the layer is a bias-free ``nn.Linear`` (``x @ W.T``), a prefill's GEMM added onto its stored delta
PROJECTION = LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE, Route.DELTA_THEN_GEMM})


class LinearWithLoRA(BaseLayerWithLoRA):
    """`nn.Linear` (weight ``[out, in]``) with one LoRA per slot.

    A fused layer that declares ``loramux_slices`` (``((module_name, width), ...)``, as
    :func:`loramux.engine.worker.siblings.fuse_siblings` does) gets one slice per original module, so
    adapters trained on the separate projections fill its slices.

    The base layer may be an FP8 `Fp8Linear`: it takes and returns activations in its
    ``activation_dtype``, which the slots take too, and its product is no plain ``x @ weight.T``,
    so it allows every route but the GEMM onto the delta; the delta's shrink reads the
    activations the FP8 GEMM quantizes, before they are quantized.
    """

    support = PROJECTION

    def __init__(self, base_layer: nn.Linear | Fp8Linear, module_name: str, lora_config: LoRAConfig) -> None:
        slices = getattr(base_layer, "loramux_slices", None) or ((module_name, base_layer.out_features),)
        super().__init__(
            base_layer,
            module_name,
            lora_config,
            in_features=base_layer.in_features,
            output_sizes=tuple(size for _, size in slices),
            slice_names=tuple(name for name, _ in slices),
            # a bias, or a subclass of nn.Linear (a quantized or scaled layer), is more than x @ W.T
            support=None if type(base_layer) is nn.Linear and base_layer.bias is None
            else self.support.without(Route.DELTA_THEN_GEMM),
            dtype=getattr(base_layer, "activation_dtype", None),
        )

    def base_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """An FP8 base's quantized activations (`Fp8Linear.quantize_input`): traced, the
        quantize fuses into the kernel that made x."""
        return list(self.base_layer.quantize_input(x)) if isinstance(self.base_layer, Fp8Linear) else []

    def run_base(self, x: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.base_layer.apply_quantized(x, *inputs) if inputs else self.base_layer(x)


class Conv1DWithLoRA(BaseLayerWithLoRA):
    """transformers' GPT-2 `Conv1D` (weight ``[in, out]``, PEFT's ``fan_in_fan_out``).

    PEFT still saves A as ``[r, in]`` and B as ``[out, r]``, so only the sizes differ from Linear.
    """

    support = PROJECTION.without(Route.DELTA_THEN_GEMM)  # its weight is [in, out]: x @ W

    def __init__(self, base_layer: nn.Module, module_name: str, lora_config: LoRAConfig) -> None:
        in_features, out_features = base_layer.weight.shape
        super().__init__(
            base_layer,
            module_name,
            lora_config,
            in_features=in_features,
            output_sizes=(out_features,),
        )
