"""Example layer plugin: LoRA for a custom fused projection, served with adapters of its parts.

``FusedQKV`` computes q, k and v with one matmul over one concatenated weight (as vLLM's
``QKVParallelLinear`` does), while the adapters were trained with PEFT on a model that has three
separate ``q_proj`` / ``k_proj`` / ``v_proj`` linears. The wrapper takes one A/B pair per part:
three output slices, filled from the sibling module names, so one shrink and one expand launch
cover all three.

Register it in-process with ``loramux.plugins.manager.register_plugin(module)``, or ship it in a
package with an entry point in group ``loramux``.
"""

from __future__ import annotations

import torch
from torch import nn

import loramux
from loramux.engine.layers import BaseLayerWithLoRA, LayerSupport, Route

PARTS = ("q_proj", "k_proj", "v_proj")


class FusedQKV(nn.Module):
    """``x [..., in] -> cat(q, k, v) [..., sum(sizes)]`` with one weight ``[sum(sizes), in]``."""

    def __init__(self, in_features: int, sizes: tuple[int, int, int]) -> None:
        super().__init__()
        self.in_features = in_features
        self.sizes = tuple(sizes)
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features))
        nn.init.normal_(self.weight, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class FusedQKVWithLoRA(BaseLayerWithLoRA):
    """Three slices (q, k, v), each filled from the adapter's ``<parent>.q_proj`` etc."""

    support = LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE, Route.DELTA_THEN_GEMM})

    def __init__(self, base_layer: FusedQKV, module_name: str, lora_config) -> None:
        parent = module_name.rpartition(".")[0]
        super().__init__(
            base_layer,
            module_name,
            lora_config,
            in_features=base_layer.in_features,
            output_sizes=base_layer.sizes,
            slice_names=[f"{parent}.{part}" if parent else part for part in PARTS],
        )


@loramux.hookimpl
def create_lora_layer(base_layer, module_name, lora_config):
    if isinstance(base_layer, FusedQKV):
        return FusedQKVWithLoRA(base_layer, module_name, lora_config)
    return None
