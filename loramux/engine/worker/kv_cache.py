"""The paged KV cache we own, and the attention that reads and writes it.

Layout: ``k, v: [layers, num_blocks, block_size, kv_heads, head_dim]``, allocated once. A
sequence owns a list of blocks (its block table, kept by `BlockManager`); the token at position
``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``. Block 0 is never
handed out: padding rows of a CUDA-graph batch have no slot to write and no keys to read.

The model runs through its own Hugging Face code with every token of the step packed into one
row, ``input_ids: [1, T]``, ``position_ids: [1, T]`` (each token's own position, so RoPE is right).
Attention is swapped for :func:`loramux_attention` through transformers' ``AttentionInterface``
(``attn_implementation="loramux"``); with an implementation transformers does not know, it builds
no mask. The layer's work is one custom op, ``loramux::attention``: write the step's K/V into the
cache (one kernel), then one paged-attention launch for every decode token and prefill chunk of
the step, reading the block tables (GQA without repeating K/V). The op is opaque to
``torch.compile`` and reads the step's metadata from :mod:`loramux.engine.worker.forward_context`, so
the compiled forward and the CUDA graphs around it hold no per-step Python state. Every model
whose attention calls ``ALL_ATTENTION_FUNCTIONS`` works (Llama, Qwen2, Mistral, Gemma and most
others in transformers 5).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from loramux.engine.worker.forward_context import current_metadata
from loramux.kernels import paged_attention, write_kv

__all__ = ["ATTN_IMPLEMENTATION", "PagedKVCache", "kv_cache_geometry", "loramux_attention"]

ATTN_IMPLEMENTATION = "loramux"


def kv_cache_geometry(config) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a model's (text) config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class PagedKVCache:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    Zero-filled, so a masked key never multiplies a NaN left in memory.
    """

    SCRATCH_BLOCK = 0  # never handed out (see the module docstring)

    def __init__(self, config, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = kv_cache_geometry(config)
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of one block over all layers."""
        layers, kv_heads, head_dim = kv_cache_geometry(config)
        return 2 * layers * block_size * kv_heads * head_dim * dtype.itemsize


@torch.library.custom_op("loramux::attention", mutates_args=("out",))
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    layer: int, scale: float, sliding_window: int, softcap: float,
) -> None:
    """``out [T, H, D]`` = paged attention of ``q [T, H, D]`` after writing ``k, v [T, Hkv, D]``.
    ``sliding_window`` 0 and ``softcap`` 0.0 mean none (custom ops take no Optional scalars here)."""
    meta = current_metadata()
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]  # [blocks, block_size, Hkv, D]
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale=scale, sliding_window=sliding_window or None, softcap=softcap or None, out=out,
    )


@_attention_op.register_fake
def _(q, k, v, out, layer, scale, sliding_window, softcap) -> None:
    return None


def loramux_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"loramux"`` attention implementation. query: [1, H, T, D]; key/value: [1, Hkv, T, D]."""
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = torch.empty_like(q)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    torch.ops.loramux.attention(q, k, v, out, module.layer_idx, scale, int(sliding_window or 0), float(softcap or 0.0))
    return out[None], None  # [1, T, H, D], like eager attention's output


AttentionInterface.register(ATTN_IMPLEMENTATION, loramux_attention)
