"""What the attention of the forward in flight needs to know, set by the model runner around it.

The model runs through its own Hugging Face code; our attention is a torch custom op
(``loramux::attention``), opaque to ``torch.compile``, which reads the step's paged-KV metadata
from here instead of through the model's arguments (vLLM's forward context). So the compiled
graph holds no per-step Python object, and a CUDA graph captured around the forward replays with
whatever the static tensors named here hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["AttentionMetadata", "current_metadata", "forward_context"]


@dataclass(eq=False)
class AttentionMetadata:
    """Where the step's tokens go in the paged cache and which keys each one sees.

    The step's ``T`` tokens are packed sequence by sequence (decodes and prefill chunks alike).
    Device tensors:
      slot_mapping:    [T] int32, the cache slot (``block * block_size + offset``) each token's K/V is
                       written to; -1 writes nothing (padding rows of a CUDA-graph batch)
      block_tables:    [B, max_blocks] int32, each sequence's blocks
      seq_lens:        [B] int32, tokens of each sequence in the cache after this step (0: padding)
      query_start_loc: [B + 1] int32, sequence b's tokens are ``[query_start_loc[b], query_start_loc[b+1])``
    """

    k_cache: torch.Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


_current: AttentionMetadata | None = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError(
            "attn_implementation='loramux' runs only inside a loramux engine step (no forward context "
            "is set); switch the model back with model.set_attn_implementation('sdpa')."
        )
    return _current


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make ``metadata`` the one the attention op reads during the forward inside this block."""
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous
