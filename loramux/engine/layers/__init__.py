"""LoRA layers: the wrapper contract (`BaseLayerWithLoRA`, `LayerSupport`, `Route`), one wrapper
per layer type, the adapter weight pool and the kernel backend behind them."""

from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.context import LoRAContext
from loramux.engine.layers.contract import LayerSupport, Route
from loramux.engine.layers.embedding import EmbeddingWithLoRA
from loramux.engine.layers.linear import Conv1DWithLoRA, LinearWithLoRA

__all__ = [
    "BaseLayerWithLoRA",
    "Conv1DWithLoRA",
    "EmbeddingWithLoRA",
    "LayerSupport",
    "LinearWithLoRA",
    "LoRAContext",
    "Route",
]
