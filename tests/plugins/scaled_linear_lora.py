"""Example layer plugin: LoRA for an int8 weight-only quantized linear layer.

``ScaledLinear`` keeps its weight as int8 ``[out, in]`` with one float scale per output channel
(the usual weight-only layout): ``y = (x @ W.T) * scale + bias``. Adapters are trained with PEFT
on the float model; served on the quantized one, each token's delta is added to its output.

The wrapper declares what the contract needs to know: the adapter weights' dtype (the
activations', since the base weight is int8), and its routes: its delta may be added after its
GEMM or computed beside it on a side stream, but a prefill may not add its GEMM onto the stored
delta (``DELTA_THEN_GEMM``): its product is scaled, not ``x @ weight.T``.

Register it in-process with ``loramux.plugins.manager.register_plugin(module)``, or ship it in a
package with an entry point in group ``loramux``.
"""

from __future__ import annotations

import torch
from torch import nn

import loramux
from loramux.engine.layers import BaseLayerWithLoRA, LayerSupport, Route


class ScaledLinear(nn.Module):
    """``y = (x @ weight.T) * scale + bias`` with ``weight`` int8 ``[out, in]``, ``scale`` ``[out]``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> ScaledLinear:
        """Per output channel: the largest weight maps to 127."""
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        weight = torch.round(w / scale[:, None]).to(torch.int8)
        return cls(weight, scale, None if linear.bias is None else linear.bias.detach().clone())

    def dequantized(self) -> nn.Linear:
        """The float layer it computes (what PEFT trains adapters on, and the oracle runs)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.scale.dtype)
        linear.weight.data = self.weight.to(self.scale.dtype) * self.scale[:, None]
        if self.bias is not None:
            linear.bias.data = self.bias.detach().clone()
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.weight.to(x.dtype).T) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias


class ScaledLinearWithLoRA(BaseLayerWithLoRA):
    support = LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE})

    def __init__(self, base_layer: ScaledLinear, module_name: str, lora_config) -> None:
        super().__init__(base_layer, module_name, lora_config, in_features=base_layer.in_features,
                         output_sizes=(base_layer.out_features,), dtype=base_layer.scale.dtype)


@loramux.hookimpl
def create_lora_layer(base_layer, module_name, lora_config):
    if isinstance(base_layer, ScaledLinear):
        return ScaledLinearWithLoRA(base_layer, module_name, lora_config)
    return None
