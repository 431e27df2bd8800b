"""loramux's own ``create_lora_layer`` hookimpl: LoRA for the layer types transformers models use.

It is ``trylast``, so a plugin that wraps one of these types differently wins over it.
"""

from __future__ import annotations

import torch
from torch import nn

from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.embedding import EmbeddingWithLoRA
from loramux.engine.layers.linear import Conv1DWithLoRA, LinearWithLoRA
from loramux.engine.quantization.fp8 import Fp8Linear
from loramux.plugins.hookspecs import hookimpl
from loramux.registry import LoRAConfig

__all__ = ["SUPPORTED_LAYER_TYPES", "builtin_lora_layer", "create_lora_layer"]

#: The layer types loramux wraps itself (subclasses included), for error messages.
SUPPORTED_LAYER_TYPES = (
    "torch.nn.Linear",
    "torch.nn.Embedding",
    "transformers.pytorch_utils.Conv1D",
    "loramux.engine.quantization.Fp8Linear",
)


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is a dependency, but the layers do not need it
        return None
    return Conv1D


def builtin_lora_layer(
    base_layer: nn.Module, module_name: str, lora_config: LoRAConfig
) -> BaseLayerWithLoRA | None:
    """The built-in wrapper for ``base_layer``, or None when its type is not one of ours."""
    if isinstance(base_layer, Fp8Linear):  # takes and returns activations in the model's dtype
        return LinearWithLoRA(base_layer, module_name, lora_config)
    weight = getattr(base_layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.element_size() < 2:
        return None  # quantized or weightless layers need a plugin that knows their layout
    if isinstance(base_layer, nn.Linear):
        return LinearWithLoRA(base_layer, module_name, lora_config)
    if isinstance(base_layer, nn.Embedding):
        return EmbeddingWithLoRA(base_layer, module_name, lora_config)
    conv1d = _conv1d_type()
    if conv1d is not None and isinstance(base_layer, conv1d):
        return Conv1DWithLoRA(base_layer, module_name, lora_config)
    return None


@hookimpl(trylast=True)
def create_lora_layer(
    base_layer: nn.Module, module_name: str, lora_config: LoRAConfig
) -> BaseLayerWithLoRA | None:
    return builtin_lora_layer(base_layer, module_name, lora_config)
