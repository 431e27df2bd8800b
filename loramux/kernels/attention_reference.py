"""Pure-torch paged attention and KV write: the CPU engine path and the oracle of the Triton kernels.

Same contract as `loramux.kernels.paged_attention` / `write_kv` (see attention.py for the
cache layout). One SDPA call per sequence: its keys are gathered through its block table, and the
G = H / Hkv query heads of a kv head are stacked along the query axis ([Hkv, G*n, D]), so K/V are
never repeated. Scores and softmax in float32 (float64 for float64 input, the tests' oracle);
output in q's dtype. Unlike the kernels it reads seq_lens and query_start_loc on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import REF_DTYPES, check_paged_attention, check_write_kv

__all__ = ["write_kv_ref", "paged_attention_ref"]


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache[slot // bs, slot % bs] = key[t] (and v) for every t with slot_mapping[t] >= 0."""
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, dtypes=REF_DTYPES)
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"write_kv: slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots")
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged keys; see
    `loramux.kernels.paged_attention`. Rows past query_start_loc[B] are left as they are
    (zeros in a fresh output)."""
    T, B, H, hkv, D = check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                            sliding_window, softcap, out, dtypes=REF_DTYPES)
    G = H // hkv
    block_size, max_blocks = k_cache.shape[1], block_tables.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    result = out if out is not None else torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if starts[0] < 0 or starts[-1] > T or any(a > b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"paged_attention: query_start_loc must rise from >= 0 to <= T={T}, got {starts}")
    for b in range(B):
        s, e, L = starts[b], starts[b + 1], lens[b]
        n = e - s
        if n == 0:
            continue
        if L == 0:  # a padding row of a CUDA-graph batch
            result[s:e] = 0
            continue
        n_blocks = -(-L // block_size)
        if L < n or n_blocks > max_blocks:
            raise ValueError(f"paged_attention: sequence {b} has seq_len {L} for {n} query tokens and a "
                             f"{max_blocks}-block table of block_size {block_size}; need n <= seq_len <= "
                             f"{max_blocks * block_size}")
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:L].to(compute).transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[blocks].flatten(0, 1)[:L].to(compute).transpose(0, 1)  # [Hkv, L, D]
        # query heads of kv head j are j*G .. j*G+G-1: stack them along the query axis
        qg = q[s:e].to(compute).reshape(n, hkv, G, D).permute(1, 2, 0, 3).reshape(hkv, G * n, D)
        q_pos = torch.arange(L - n, L, device=q.device)[:, None]
        k_pos = torch.arange(L, device=q.device)[None, :]
        visible = k_pos <= q_pos  # [n, L]
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        visible = visible.repeat(G, 1)  # row g*n + i is query i
        if softcap is None:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible, scale=scale)
        else:
            scores = torch.tanh((qg @ k.transpose(1, 2)) * (scale / softcap)) * softcap
            o = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
        result[s:e] = o.view(hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D).to(q.dtype)
    return result
