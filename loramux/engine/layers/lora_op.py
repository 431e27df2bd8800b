"""``loramux::apply_lora``: a LoRA layer's delta as one torch custom op.

``torch.compile`` sees an opaque op that adds into the base layer's output, so it traces none of
the per-step Python (the mapping, the kernel metadata, which slots a layer holds), and the
compiled forward never recompiles as adapters come and go. The op finds its layer by an integer
id handed out when the wrapper is built, and the layer reads the step's mapping from its
`LoRAContext`. The same op runs in eager mode; under a CUDA-graph capture it records whatever
kernels the context's metadata asks for (none when the graph is captured without adapters).
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["register_layer"]

_layers: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_ids = itertools.count()


def register_layer(layer: torch.nn.Module) -> int:
    """A process-unique id for ``layer`` (a `BaseLayerWithLoRA`), never reused."""
    layer_id = next(_ids)
    _layers[layer_id] = layer
    return layer_id


@torch.library.custom_op("loramux::apply_lora", mutates_args=("output",))
def _apply_lora(output: torch.Tensor, x: torch.Tensor, layer_id: int) -> None:
    _layers[layer_id].add_lora_delta(x, output)


@_apply_lora.register_fake
def _(output, x, layer_id) -> None:
    return None
