"""LoRA layer wrappers: one per layer type, all following `BaseLayerWithLoRA`'s contract."""

from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.context import LoRAContext
from loramux.engine.layers.embedding import EmbeddingWithLoRA
from loramux.engine.layers.linear import Conv1DWithLoRA, LinearWithLoRA

__all__ = [
    "BaseLayerWithLoRA",
    "Conv1DWithLoRA",
    "EmbeddingWithLoRA",
    "LinearWithLoRA",
    "LoRAContext",
]
