"""Example layer plugin: LoRA support for a layer type loramux does not know.

``ToyScale`` multiplies its input elementwise by a weight vector; no built-in wrapper handles it,
so only this plugin's ``create_lora_layer`` answers for it. The wrapper is a toy (it adds
nothing); it shows the hook's contract: a module wrapping ``base_layer``, or None.
"""

from __future__ import annotations

import torch
from torch import nn

import loramux


class ToyScale(nn.Module):
    """``y = x * weight``, elementwise."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class ToyScaleWithLoRA(nn.Module):
    """The wrapper: keeps ``base_layer`` and the arguments it was built with."""

    def __init__(self, base_layer: ToyScale, module_name: str, lora_config) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.module_name = module_name
        self.lora_config = lora_config

    def get_base_layer(self) -> nn.Module:
        return self.base_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


@loramux.hookimpl
def create_lora_layer(base_layer, module_name, lora_config):
    if isinstance(base_layer, ToyScale):
        return ToyScaleWithLoRA(base_layer, module_name, lora_config)
    return None
