"""``loramux::lora_layer``: a LoRA layer's whole forward (base layer and delta) as one torch custom op.

``torch.compile`` sees one opaque op per wrapped layer, so it traces none of the per-step Python
(the mapping, the kernel metadata, which slots a layer holds), the compiled forward never
recompiles as adapters come and go, and nothing can move the base layer's GEMM away from the
shrink launched beside it on a side stream (`BaseLayerWithLoRA.lora_forward`). The op finds its
layer by an integer id handed out when the wrapper is built, and the layer reads the step's
mapping from its `LoRAContext`. The same op runs in eager mode; under a CUDA-graph capture it
records the base layer's kernels and whatever LoRA kernels the context's metadata asks for (none,
and no stream fork, when the graph is captured without adapters).

The op returns a new tensor. Its fake (what ``torch.compile`` traces with) cannot ask the layer
for the output's shape, since the layer id is a symbolic int there (one compiled graph serves
every decoder layer), so the caller passes the shape and dtype it expects
(`BaseLayerWithLoRA.base_output_spec`), and the real op checks them.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

__all__ = ["register_layer"]

_layers: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_ids = itertools.count()


def register_layer(layer: torch.nn.Module) -> int:
    """A process-unique id for ``layer`` (a `BaseLayerWithLoRA`), never reused."""
    layer_id = next(_ids)
    _layers[layer_id] = layer
    return layer_id


@torch.library.custom_op("loramux::lora_layer", mutates_args=())
def _lora_layer(x: torch.Tensor, layer_id: int, out_shape: Sequence[int], out_dtype: torch.dtype) -> torch.Tensor:
    layer = _layers[layer_id]
    output = layer.lora_forward(x)
    if tuple(output.shape) != tuple(out_shape) or output.dtype != out_dtype:
        raise ValueError(
            f"{type(layer).__name__}({layer.module_name!r}): its base layer returned {output.dtype} "
            f"{list(output.shape)} for input {list(x.shape)}, but base_output_spec said {out_dtype} "
            f"{list(out_shape)}; override base_output_spec (and rows_shape) to describe what the base "
            "layer returns"
        )
    return output


@_lora_layer.register_fake
def _(x, layer_id, out_shape, out_dtype) -> torch.Tensor:
    return x.new_empty(out_shape, dtype=out_dtype)  # contiguous, as `lora_forward` returns
