"""Example layer plugin: LoRA for a 1x1 convolution (``nn.Conv1d`` with ``kernel_size=1``).

A pointwise convolution mixes the channels of ``x [B, C, L]`` at every position: a linear layer
over each position's channels, but its tokens are ``(B, L)``, its features in dim 1, and PEFT
saves its LoRA as convolution weights, A ``[r, C, 1]`` and B ``[out, r, 1]``. The wrapper maps
all of that with the contract's hooks: ``adapter_matrices`` (the weight layout), ``rows_shape``,
``lora_input`` and ``delta_as_output`` (the activations' layout), ``base_output_spec`` and
``example_input``. Its output is not rows of tokens, so the delta is added apart
(``DELTA_APART``), or beside the convolution on a side stream in step graphs.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

import loramux
from loramux.engine.layers import BaseLayerWithLoRA, LayerSupport, Route


class Conv1x1WithLoRA(BaseLayerWithLoRA):
    support = LayerSupport({Route.DELTA_APART, Route.DELTA_BESIDE})

    def __init__(self, base_layer: nn.Conv1d, module_name: str, lora_config) -> None:
        super().__init__(base_layer, module_name, lora_config, in_features=base_layer.in_channels,
                         output_sizes=(base_layer.out_channels,))

    def adapter_matrices(self, weights):
        # PEFT: A [r, in, 1], B [out, r, 1]
        return replace(weights, lora_a=weights.lora_a.flatten(1), lora_b=weights.lora_b.flatten(1))

    def rows_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return x.shape[0], x.shape[2]  # x: [B, C, L]

    def base_output_spec(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        _, dtype = super().base_output_spec(x)
        return (x.shape[0], self.out_features, x.shape[2]), dtype

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.movedim(1, -1).reshape(-1, self.in_features).to(self.lora_dtype)  # [B * L, C]

    def delta_as_output(self, delta: torch.Tensor) -> torch.Tensor:
        return delta.movedim(-1, 1)  # [B, L, out] -> [B, out, L]

    def example_input(self, num_tokens: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(1, self.in_features, num_tokens, generator=generator).to(self.lora_device, self.lora_dtype)


@loramux.hookimpl
def create_lora_layer(base_layer, module_name, lora_config):
    if isinstance(base_layer, nn.Conv1d) and base_layer.kernel_size == (1,) and base_layer.groups == 1:
        return Conv1x1WithLoRA(base_layer, module_name, lora_config)
    return None
