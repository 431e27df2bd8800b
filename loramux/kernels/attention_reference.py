"""Pure-torch paged attention and KV write: the CPU engine path and the oracle of the Triton kernels.

Same contract as `loramux.kernels.paged_attention` / `write_kv` (see attention.py for the
cache layout). The step's sequences are attended together, a few SDPA calls per layer rather than
one per sequence (Python's per-call cost dominates small CPU steps): sequences of similar query
count and length share a bucket (see `_buckets`), whose keys are gathered through the block tables
into a padded [B, Hkv, Lmax, D] and whose queries are padded to [B, Hkv, G*nmax, D], the
G = H / Hkv query heads of a kv head stacked along the query axis so K/V are never repeated. One
boolean mask carries causality, the sliding window and the padding. Scores and softmax in float32
(float64 for float64 input); output in q's dtype. Unlike the kernels it reads seq_lens and
query_start_loc on the host.
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
    block_size, max_blocks = k_cache.shape[1], block_tables.shape[1]
    result = out if out is not None else torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if starts[0] < 0 or starts[-1] > T or any(a > b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"paged_attention: query_start_loc must rise from >= 0 to <= T={T}, got {starts}")
    rows = []  # (n, L, b) of each sequence to attend
    for b in range(B):
        s, e, L = starts[b], starts[b + 1], lens[b]
        n = e - s
        if n == 0:
            continue
        if L == 0:  # a padding row of a CUDA-graph batch
            result[s:e] = 0
            continue
        if L < n or -(-L // block_size) > max_blocks:
            raise ValueError(f"paged_attention: sequence {b} has seq_len {L} for {n} query tokens and a "
                             f"{max_blocks}-block table of block_size {block_size}; need n <= seq_len <= "
                             f"{max_blocks * block_size}")
        rows.append((n, L, b))
    for n_max, l_max, bucket in _buckets(rows):
        _attend_bucket(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, result,
                       torch.tensor(bucket, device=q.device), n_max, l_max, scale, sliding_window, softcap)
    return result


def _buckets(rows: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]]:
    """(n_max, L_max, sequence ids) batches of the (n, L, b) rows whose padded size
    (rows * n_max * L_max) stays within twice their real one (the sum of n * L): a long prefill
    chunk then does not pad a batch of decodes, nor one long decode many short ones."""
    buckets: list[tuple[int, int, list[int]]] = []
    real = 0
    for n, L, b in sorted(rows, reverse=True):  # by n, then L, largest first
        if buckets:
            n_max, l_max, ids = buckets[-1]
            if (len(ids) + 1) * n_max * max(l_max, L) <= 2 * (real + n * L):
                buckets[-1] = (n_max, max(l_max, L), ids + [b])
                real += n * L
                continue
        buckets.append((n, L, [b]))
        real = n * L
    return buckets


def _attend_bucket(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, result, ids, n_max, l_max,
                   scale, sliding_window, softcap) -> None:
    """result's rows of sequences ``ids`` ([b] int64): one padded attention over all of them."""
    _, block_size, hkv, D = k_cache.shape
    nb, H = len(ids), q.shape[1]
    G = H // hkv
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    start = query_start_loc[ids].long()[:, None]  # [b, 1]
    n = query_start_loc[ids + 1].long()[:, None] - start  # [b, 1]
    L = seq_lens[ids].long()[:, None]  # [b, 1]
    i = torch.arange(n_max, device=q.device)  # query i of a sequence is at position L - n + i
    owned = (i < n).view(-1).nonzero().squeeze(1)  # the real queries among the b * n_max
    q_rows = torch.where(i < n, start + i, start).view(-1)  # padding queries read the first: none past T
    q_pos = (L - n + i)[:, :, None]  # [b, n_max, 1]
    # keys past L read the last key (finite, unlike a slot no sequence owns) and are masked
    k_pos = torch.minimum(torch.arange(l_max, device=q.device), L - 1)  # [b, l_max]
    slots = (block_tables[ids].long().gather(1, k_pos // block_size) * block_size + k_pos % block_size).view(-1)
    # index_select, not advanced indexing: several times faster on CPU for these gathers
    k = k_cache.flatten(0, 1).index_select(0, slots).to(compute).view(nb, l_max, hkv, D).transpose(1, 2)
    v = v_cache.flatten(0, 1).index_select(0, slots).to(compute).view(nb, l_max, hkv, D).transpose(1, 2)
    # query heads of kv head j are j*G .. j*G+G-1: stack them along the query axis (row g*n_max + i)
    qg = q.index_select(0, q_rows).to(compute).view(nb, n_max, hkv, G, D).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(nb, hkv, G * n_max, D)
    key_pos = torch.arange(l_max, device=q.device)
    visible = key_pos <= q_pos  # [b, n_max, l_max]: also hides the keys past L from real queries
    if sliding_window is not None:
        visible &= q_pos - key_pos < sliding_window
    visible = visible[:, None].expand(nb, G, n_max, l_max).reshape(nb, 1, G * n_max, l_max)
    if softcap is None:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible, scale=scale)
    else:
        scores = torch.tanh((qg @ k.transpose(-1, -2)) * (scale / softcap)) * softcap
        o = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
    o = o.view(nb, hkv, G, n_max, D).permute(0, 3, 1, 2, 4).reshape(nb * n_max, H, D)
    result.index_copy_(0, q_rows[owned], o.index_select(0, owned).to(q.dtype))
