"""LoRA on token embeddings (`nn.Embedding` and subclasses such as Gemma's scaled embedding).

PEFT's embedding LoRA is ``delta = A.T[token_id] @ B.T * scaling`` with A ``[r, vocab]`` and
B ``[dim, r]``: the shrink is a gather of one column of A per token (`embedding_shrink`, one
launch on CUDA), the expand is the usual kernel. An embedding that scales its own output
(``embed_scale``, Gemma) scales the delta too, as PEFT does. A lookup is no GEMM to hide a
shrink behind: the delta runs after it, on the main stream (its own ``apply_lora``).
"""

from __future__ import annotations

import torch
from torch import nn

from loramux.engine.layers.base import BaseLayerWithLoRA
from loramux.engine.layers.contract import LayerSupport
from loramux.kernels import LoRABatchMeta, lora_expand
from loramux.kernels.embedding import embedding_shrink
from loramux.registry import LoRAConfig

__all__ = ["EmbeddingWithLoRA"]


class EmbeddingWithLoRA(BaseLayerWithLoRA):
    """`nn.Embedding` (weight ``[vocab, dim]``) with one embedding LoRA per slot.

    Pooled as the projections are, with ``in_features = vocab``: ``slots.lora_a [U, 1, vocab]``
    (a slot's rank row j at its start + j), ``slots.lora_b`` holding a ``[dim, width]`` block
    per slot; a dense ``[max_loras, R, vocab]`` per slot would take 4 GB at 256 slots of rank 64
    with a 128k vocabulary.
    """

    is_embedding = True
    support = LayerSupport(own_delta=True)

    def __init__(self, base_layer: nn.Embedding, module_name: str, lora_config: LoRAConfig) -> None:
        super().__init__(
            base_layer,
            module_name,
            lora_config,
            in_features=base_layer.num_embeddings,
            output_sizes=(base_layer.embedding_dim,),
        )

    def scale_multiplier(self) -> float:
        embed_scale = getattr(self.base_layer, "embed_scale", None)
        if embed_scale is None:
            return 1.0
        if isinstance(embed_scale, torch.Tensor):
            # the base layer applies it in its weight dtype; so does PEFT to the delta
            return float(embed_scale.to(self.lora_dtype))
        return float(embed_scale)

    def rows_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)  # token ids: every dim indexes tokens

    def base_output_spec(self, x: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        return (*x.shape, self.out_features), self.base_layer.weight.dtype  # a lookup: no autocast

    def example_input(self, num_tokens: int) -> torch.Tensor:
        return torch.arange(num_tokens, device=self.lora_device) % self.in_features  # token ids

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor, meta: LoRABatchMeta) -> None:
        s = self.slots
        # buf: [T, R] f32 = A[slot][j, token] * scale[slot] for j < the slot's rank, else 0
        buf = embedding_shrink(x.reshape(-1), meta.token_slots, s.lora_a, s.pool_starts, s.ranks, s.scales,
                               s.max_lora_rank)
        lora_expand(y, buf, s.lora_b, self.output_sizes, meta, s.ranks, pool_starts=s.pool_starts)
