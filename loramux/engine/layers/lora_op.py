"""The LoRA layer's forward as torch custom ops: ``torch.compile`` sees one opaque op per wrapped layer.

So it traces none of the per-step Python (the mapping, the kernel metadata, which slots a layer
holds), the compiled forward never recompiles as adapters come and go, and nothing can move the
base layer's GEMM away from the LoRA work forked beside it on a side stream. Two ops:

- ``loramux::lora_layer(x, ...)``: base output plus delta in one tensor (`backend.run_in_order`):
  the base layer then its delta, or a prefill's delta then its GEMM;
- ``loramux::lora_delta(x, base_inputs, ...)``: the base output and the delta apart
  (`backend.run_apart`), the delta computed beside the base GEMM on CUDA; the layer adds them in
  traced code, so the compiled layer folds the sum into its next kernel. ``base_inputs``: what
  the base layer computes from x first, traced (`BaseLayerWithLoRA.base_inputs`).

An op finds its layer by an integer id handed out when the wrapper is built, and the layer reads
the step's mapping from its `LoRAContext`. The ops run in eager mode too; under a CUDA-graph
capture they record the base layer's kernels and whatever LoRA kernels the context's metadata
asks for (none, and no stream fork, when the graph is captured without adapters).

The ops return new tensors. Their fakes (what ``torch.compile`` traces with) cannot ask the layer
for the output's shape, since the layer id is a symbolic int there (one compiled graph serves
every decoder layer), so the caller passes the shapes and dtypes it expects
(`BaseLayerWithLoRA.base_output_spec`), and the real op checks them.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from loramux.engine.layers import backend

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
    output = backend.run_in_order(layer, x)
    _check_output(layer, x, output, out_shape, out_dtype)
    return output


@_lora_layer.register_fake
def _(x, layer_id, out_shape, out_dtype) -> torch.Tensor:
    return x.new_empty(out_shape, dtype=out_dtype)  # contiguous, as `backend.run_in_order` returns


@torch.library.custom_op("loramux::lora_delta", mutates_args=())
def _lora_delta(x: torch.Tensor, base_inputs: list[torch.Tensor], layer_id: int, out_shape: Sequence[int],
                out_dtype: torch.dtype, delta_shape: Sequence[int],
                delta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layer = _layers[layer_id]
    output, delta = backend.run_apart(layer, x, base_inputs)
    _check_output(layer, x, output, out_shape, out_dtype)
    return output, delta


@_lora_delta.register_fake
def _(x, base_inputs, layer_id, out_shape, out_dtype, delta_shape, delta_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # contiguous, as `backend.run_apart` returns them
    return x.new_empty(out_shape, dtype=out_dtype), x.new_empty(delta_shape, dtype=delta_dtype)


def _check_output(layer: torch.nn.Module, x: torch.Tensor, output: torch.Tensor, out_shape: Sequence[int],
                  out_dtype: torch.dtype) -> None:
    if tuple(output.shape) != tuple(out_shape) or output.dtype != out_dtype:
        raise ValueError(
            f"{type(layer).__name__}({layer.module_name!r}): its base layer returned {output.dtype} "
            f"{list(output.shape)} for input {list(x.shape)}, but base_output_spec said {out_dtype} "
            f"{list(out_shape)}; override base_output_spec (and rows_shape) to describe what the base "
            "layer returns"
        )
