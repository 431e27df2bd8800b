"""The KV cache we own, and the attention function that reads and writes it.

Layout: one row per running sequence (plus a scratch row), preallocated for ``max_model_len``
tokens: ``k, v: [layers, rows + 1, kv_heads, max_model_len, head_dim]``. The cache is bounded by
``max_num_seqs x max_model_len`` and allocated once; a sequence takes a row on admission and
gives it back when it finishes (rows are handed out lowest first, so the rows in use stay dense).

The model runs through its own Hugging Face code with every token of the step packed into one
row, ``input_ids: [1, T]``, ``position_ids: [1, T]`` (each token's own position, so RoPE is
right). Attention is swapped for :func:`loramux_attention` through transformers'
``AttentionInterface`` (``attn_implementation="loramux"``); with an implementation transformers
does not know, it builds no mask at all, and :class:`AttentionBatch`, passed as the
``loramux_batch`` keyword, tells each layer where every token's K/V goes and which keys each
query may see. That works for every model whose attention calls ``ALL_ATTENTION_FUNCTIONS``
(Llama, Qwen2, Mistral, Gemma and most others in transformers 5).

Per layer: one scatter writes the step's K/V; all single-token queries (decodes) go through one
batched SDPA over ``cache[:R, :, :L]`` (a view, no copy), with grouped-query heads folded into
the query length so K/V are never repeated; each multi-token chunk (a prefill) gets one causal
SDPA over its row's prefix and itself. Masks are built once per step and shared by all layers;
nothing here syncs with the host.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

__all__ = ["ATTN_IMPLEMENTATION", "AttentionBatch", "KVCache", "kv_cache_shape", "loramux_attention"]

ATTN_IMPLEMENTATION = "loramux"


def kv_cache_shape(config, rows: int, max_len: int) -> tuple[int, int, int, int, int]:
    """``(layers, rows, kv_heads, max_len, head_dim)`` for a model's (text) config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (config.num_hidden_layers, rows, kv_heads, max_len, head_dim)


class KVCache:
    """Preallocated keys and values for ``rows`` sequences of up to ``max_len`` tokens each.

    Zero-filled, so a masked key never multiplies a NaN left in memory. ``allocate`` hands out
    the lowest free row; ``free`` takes it back. Row ``SCRATCH_ROW`` (0) is never handed out:
    the padding tokens of a CUDA-graph step write there, so the sequences' rows are
    ``1..rows`` and the tensors hold ``num_rows = rows + 1``.
    """

    SCRATCH_ROW = 0

    def __init__(self, config, *, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = kv_cache_shape(config, rows + 1, max_len)
        self.num_layers, self.num_rows, self.num_kv_heads, self.max_len, self.head_dim = shape
        self.rows = rows
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(1, rows + 1))  # a heap: lowest row first
        self._used: set[int] = set()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        assert self._free, "KVCache.allocate: no free row (check can_allocate first)"
        row = heapq.heappop(self._free)
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        assert row in self._used, f"KVCache.free: row {row} is not allocated"
        self._used.remove(row)
        heapq.heappush(self._free, row)


@dataclass(eq=False)
class AttentionBatch:
    """Where the tokens of one step go in the cache, built once per step by the model runner.

    Tokens ``[0, num_decode)`` are single-token queries; their rows are ``decode_rows``.
    ``prefills`` lists ``(first_token, num_tokens, row, start_position)`` per multi-token chunk.
    Device tensors: ``write_rows, write_positions: [T]`` (cache row and position per token),
    ``decode_rows: [num_decode]``, ``decode_positions: [R]`` (the query position per row below
    ``R = decode_pad_rows``; rows without a decode hold 0).
    """

    kv: KVCache
    write_rows: torch.Tensor
    write_positions: torch.Tensor
    num_decode: int
    decode_rows: torch.Tensor
    decode_positions: torch.Tensor
    decode_pad_rows: int
    decode_max_len: int
    prefills: list[tuple[int, int, int, int]]
    _per_step: dict = field(default_factory=dict, repr=False)  # masks and scratch shared by layers

    def decode_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, 1, L] additive (0 / -inf): row r's query sees keys at positions <= its own
        (within the window). Additive in the query's dtype, so SDPA converts nothing per layer."""
        key = ("decode", window, dtype)
        if key not in self._per_step:
            keys = torch.arange(self.decode_max_len, device=self.decode_positions.device)
            pos = self.decode_positions[:, None]
            visible = keys[None, :] <= pos
            if window is not None:
                visible &= pos - keys[None, :] < window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._per_step[key] = mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        return self._per_step[key]

    def prefill_mask(self, index: int, window: int | None, device: torch.device) -> torch.Tensor:
        """[n, start + n] bool causal mask of chunk ``index`` (offset by its cached prefix)."""
        key = ("prefill", index, window)
        if key not in self._per_step:
            _, n, _, start = self.prefills[index]
            q = torch.arange(start, start + n, device=device)[:, None]
            k = torch.arange(start + n, device=device)[None, :]
            mask = k <= q
            if window is not None:
                mask &= q - k < window
            self._per_step[key] = mask
        return self._per_step[key]


def _attend(q, k, v, *, mask=None, causal=False, scale=None, softcap=None):
    """SDPA with grouped-query heads; q: [B, H, Q, D], k/v: [B, Hkv, K, D] -> [B, H, Q, D]."""
    n_rep = q.shape[1] // k.shape[1]
    if softcap is None:
        if mask is None:  # flash / efficient kernels take GQA natively
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=n_rep > 1)
        if n_rep > 1:  # a masked GQA call may fall back to a slow path: repeat this one row instead
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # logit soft-capping (Gemma 2): SDPA has no hook for it, so do it by hand
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1).to(v.dtype)) @ v


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
    loramux_batch: AttentionBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"loramux"`` attention implementation. query: [1, H, T, D]; key/value: [1, Hkv, T, D]."""
    batch = loramux_batch
    if batch is None:
        raise RuntimeError(
            "attn_implementation='loramux' runs only inside a loramux engine step (no loramux_batch "
            "was passed); switch the model back with model.set_attn_implementation('sdpa')."
        )
    _, num_heads, num_tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    k_cache, v_cache = batch.kv.k[module.layer_idx], batch.kv.v[module.layer_idx]  # [S, Hkv, L, D]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k_cache[batch.write_rows, :, batch.write_positions] = k_new.to(k_cache.dtype)
    v_cache[batch.write_rows, :, batch.write_positions] = v_new.to(v_cache.dtype)

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = q.new_empty(num_tokens, num_heads, head_dim)
    nd = batch.num_decode
    if nd:
        rows, length = batch.decode_pad_rows, batch.decode_max_len
        # GQA folded into the query length: [R, Hkv, n_rep, D] against [R, Hkv, L, D]
        shape = (rows, kv_heads, num_heads // kv_heads, head_dim)
        q_pad = batch._per_step.get(("q_pad", shape, q.dtype))
        if q_pad is None:  # one per step: every layer rewrites the same rows, the others stay zero
            q_pad = batch._per_step[("q_pad", shape, q.dtype)] = q.new_zeros(shape)
        q_pad.index_copy_(0, batch.decode_rows, q[:nd].reshape(nd, kv_heads, -1, head_dim))
        o = _attend(
            q_pad,
            k_cache[:rows, :, :length],
            v_cache[:rows, :, :length],
            mask=batch.decode_mask(sliding_window, q.dtype),
            scale=scaling,
            softcap=softcap,
        )
        out[:nd] = o.index_select(0, batch.decode_rows).reshape(nd, num_heads, head_dim)
    for index, (first, n, row, start) in enumerate(batch.prefills):
        qi = q[first : first + n].transpose(0, 1)[None]  # [1, H, n, D]
        ki, vi = k_cache[row, :, : start + n][None], v_cache[row, :, : start + n][None]
        if start == 0 and sliding_window is None:
            o = _attend(qi, ki, vi, causal=True, scale=scaling, softcap=softcap)
        else:
            mask = batch.prefill_mask(index, sliding_window, q.device)
            o = _attend(qi, ki, vi, mask=mask, scale=scaling, softcap=softcap)
        out[first : first + n] = o[0].transpose(0, 1)
    return out[None], None  # [1, T, H, D], like eager attention's output


AttentionInterface.register(ATTN_IMPLEMENTATION, loramux_attention)
