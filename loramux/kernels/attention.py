"""Paged attention and the KV write (Triton): decode tokens and prefill chunks of many sequences in
one launch per layer, with a launch grid that depends on tensor shapes only (CUDA graphs,
torch.compile: no host sync, no value read on the host).

Cache layout
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_size a power of two (16 by default).
    Token p of a sequence lives in block block_table[p // block_size] at offset p % block_size; its
    flat slot is block_id * block_size + offset. `write_kv` stores a step's keys/values by slot
    (one program per token; slot -1 = padding, skipped).

Batch layout
    q: [T, H, D]; sequence b's n_b = qsl[b+1] - qsl[b] queries are q[qsl[b]:qsl[b+1]] (qsl =
    query_start_loc, qsl[0] = 0), at positions seq_lens[b] - n_b ... seq_lens[b] - 1; each sees
    keys 0 .. its own position (and, with a sliding window w, only keys with q_pos - k_pos < w).
    A row with seq_len 0 (CUDA-graph padding) gets zeros and reads no block.

Algorithm (one kernel, FlashAttention-2 style online softmax in float32)
    A program owns BLOCK_M rows = BLOCK_Q query tokens x the G = H / Hkv query heads of one kv
    head (row r: token r // G, head kv_head * G + r % G), so each K/V tile is loaded once and
    used by the whole GQA group; K/V are never repeated. Query blocks are numbered sequence after
    sequence, sequence b's from qsl[b] // BLOCK_Q + b, so T // BLOCK_Q + B blocks cover any batch
    of T tokens in B sequences: grid = (T // BLOCK_Q + B, Hkv, num_splits). A program finds its
    sequence from one vector load of qsl (count of block starts <= its index) and returns at once
    if its block holds no query. It then walks BLOCK_N-key tiles from the window's first key to
    its last query's position, each key's block looked up in the block table (any block size /
    tile size ratio). Tiles whose keys every query of the block sees run without score masks;
    the rest (the causal diagonal, the sequence end, any sliding window) run masked.

    Split-KV (flash-decoding): when the grid is too small to fill the GPU (few long sequences),
    num_splits > 1 programs share a query block's key range (each at least MIN_KEYS_PER_SPLIT
    keys, so short sequences leave the extra programs idle). Each writes its normalized partial
    output and log-sum-exp to a float32 scratch [T, H, splits, D]; a second kernel (grid (T, H))
    merges them. num_splits comes from shapes (grid size vs SM count, max_blocks) only.

Head dims up to 256; a non-power-of-two head dim is padded to the next power of two (>= 16) with
masks. Scores/softmax in float32, P @ V in the cache dtype with float32 accumulation (float32
inputs: IEEE products), output in q's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_paged_attention, check_write_kv
from .tiles import cdiv, dot_precision, next_pow2, target_programs

MAX_HEAD_DIM = 256
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# KV write


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_slots,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_wb, stride_ws, stride_wh, stride_wd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # padding (-1); a slot past the cache is never written
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    v_dst = blk * stride_wb + off * stride_ws + offs_h[:, None] * stride_wh + offs_d[None, :] * stride_wd
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton KV write; same contract as `loramux.kernels.write_kv`. Slots outside the cache are
    skipped (the reference raises)."""
    T = check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    num_blocks, block_size, hkv, d = k_cache.shape
    sk, sv, sc, sw = key.stride(), value.stride(), k_cache.stride(), v_cache.stride()
    _write_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping, num_blocks * block_size,
        sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sc[0], sc[1], sc[2], sc[3], sw[0], sw[1], sw[2], sw[3],
        NUM_KV_HEADS=hkv, HEAD_DIM=d, H_PAD=next_pow2(hkv), D_PAD=next_pow2(d), BLOCK_SIZE=block_size,
        num_warps=4 if hkv * d >= 1024 else 1,
    )


# ---------------------------------------------------------------------------------------------
# attention


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact at both tails (e^2x -> inf or 0); no libdevice (runs in the interpreter)
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, tile_lo, tile_hi, table_row, k_ptr, v_ptr, kv_end, max_blocks, num_blocks,
    q_pos, row_valid, offs_d, d_mask, score_scale, softcap_log2, window,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_tn,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi) (k_ptr/v_ptr already at the kv head).
    MASKED: apply the causal, window and row masks (else every key is visible to every row)."""
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        block_idx = offs_n // BLOCK_SIZE
        key_in = offs_n < kv_end
        blk = tl.load(table_row + block_idx * stride_tn, mask=key_in & (block_idx < max_blocks), other=0)
        key_in = key_in & (blk >= 0) & (blk < num_blocks)  # a bad block id is never read
        blk = blk.to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(k_ptr + (blk * stride_kb + in_block * stride_ks)[None, :] + offs_d[:, None] * stride_kd,
                    mask=key_in[None, :] & d_mask[:, None], other=0.0)  # [D, BN]
        s = tl.dot(q, k, input_precision=PRECISION)  # [BM, BN] float32
        if USE_SOFTCAP:
            s = _tanh(s * score_scale) * softcap_log2
        else:
            s = s * score_scale  # scores in log2 units from here on
        if MASKED:
            visible = row_valid[:, None] & key_in[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = m_new
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :] * stride_vd,
                    mask=key_in[:, None] & d_mask[None, :], other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# the block-table width varies with the longest sequence: no kernel per "divisible by 16" of it
@triton.jit(do_not_specialize=["num_seqs", "max_blocks", "num_blocks", "window", "stride_tb"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr,
    num_seqs, max_blocks, num_blocks, score_scale, softcap_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_os, stride_od,
    stride_lt, stride_lh,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_TILES_PER_SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # the sequence: the last b whose first query block qsl[b] // BLOCK_Q + b is <= pid_q
    offs_s = tl.arange(0, SEQ_PAD)
    in_batch = offs_s < num_seqs
    first_block = tl.load(qsl_ptr + offs_s, mask=in_batch, other=0) // BLOCK_Q + offs_s
    b = tl.sum((in_batch & (first_block <= pid_q)).to(tl.int32), axis=0) - 1
    if b < 0:
        return
    q_start = tl.load(qsl_ptr + b)
    n_q = tl.load(qsl_ptr + b + 1) - q_start
    q_lo = (pid_q - (q_start // BLOCK_Q + b)) * BLOCK_Q  # this block's first query, within the sequence
    if q_lo >= n_q:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - n_q  # keys cached before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_lo + offs_m // G
    head = kv_head * G + offs_m % G
    row_valid = (offs_m < BLOCK_Q * G) & (q_tok < n_q)
    q_pos = context + q_tok
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BM, D]

    # keys [kv_start, kv_end): up to the last query's position, from the first query's window
    kv_end = tl.maximum(context + tl.minimum(q_lo + BLOCK_Q, n_q), 0)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context + q_lo - window + 1, 0)
    tile_begin = kv_start // BLOCK_N
    tile_end = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        per_split = tl.maximum(tl.cdiv(tl.maximum(tile_end - tile_begin, 0), NUM_SPLITS), MIN_TILES_PER_SPLIT)
        tile_begin = tile_begin + split * per_split
        tile_end = tl.minimum(tile_begin + per_split, tile_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    kv_off = kv_head.to(tl.int64) * stride_kh
    vv_off = kv_head.to(tl.int64) * stride_vh
    # tiles below full_end hold only keys every query of the block sees: no score masks there
    full_end = tile_begin
    if not USE_WINDOW:
        full_end = tl.minimum(tl.maximum(context + q_lo + 1, 0) // BLOCK_N, tile_end)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, tile_begin, full_end, table_row, k_ptr + kv_off, v_ptr + vv_off, kv_end, max_blocks,
        num_blocks, q_pos, row_valid, offs_d, d_mask, score_scale, softcap_log2, window,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_tn,
        BLOCK_SIZE, BLOCK_N, False, USE_WINDOW, USE_SOFTCAP, PRECISION)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, tl.maximum(full_end, tile_begin), tile_end, table_row, k_ptr + kv_off, v_ptr + vv_off,
        kv_end, max_blocks, num_blocks, q_pos, row_valid, offs_d, d_mask, score_scale, softcap_log2, window,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_tn,
        BLOCK_SIZE, BLOCK_N, True, USE_WINDOW, USE_SOFTCAP, PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]  # rows without keys: 0
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os
    tl.store(o_ptrs + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, qsl_ptr, num_seqs,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if (t < tl.load(qsl_ptr)) | (t >= tl.load(qsl_ptr + num_seqs)):  # no query wrote this row
        return
    t = t.to(tl.int64)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_in = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + offs_s, mask=s_in, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    denom = tl.sum(w, axis=0)
    parts = tl.load(part_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_in[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # [S, D]
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape. block_m: rows per program (block_m // G query tokens x G heads; a power of
    two >= max(16, G)); block_n: keys per tile (power of two >= 16); num_splits: programs sharing
    one query block's keys (1 = no split-KV), each taking at least split_min_keys keys."""

    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    split_min_keys: int = MIN_KEYS_PER_SPLIT


@functools.lru_cache(maxsize=1024)
def attention_config(
    T: int, B: int, H: int, hkv: int, D: int, max_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> AttentionConfig:
    """Heuristic launch shape from shapes only. Decode (T <= B): 16-row blocks (one token x G
    heads, padded), the bytes of K/V are the cost. Prefill: 64- or 128-row blocks reuse each K/V
    tile for many queries. Split-KV when the grid would not fill the GPU."""
    G = H // hkv
    d_pad = max(16, next_pow2(D))
    if T <= B:
        block_m, num_warps, num_stages = max(16, next_pow2(G)), 4, 3
    elif T >= 128 * B and d_pad <= 128:
        block_m, num_warps, num_stages = max(128, next_pow2(G)), 8, 2
    else:
        block_m, num_warps, num_stages = max(64, next_pow2(G)), 4, 2
    programs = (T // (block_m // G) + B) * hkv
    target = target_programs(device)
    splits = 1
    if programs < target:
        splits = max(1, min(MAX_SPLITS, cdiv(target, programs), max_blocks * block_size // MIN_KEYS_PER_SPLIT))
    block_n = 64 if d_pad <= 128 else 32
    if T <= B:  # decode, the fastest of a sweep on the GPU (8B shapes, block 16): without splits
        # 32-key tiles, 2 stages; with splits (few long sequences) 128-key tiles
        block_n, num_stages = (32 if splits == 1 else (128 if d_pad <= 128 else 32)), 2
    if dtype == torch.float32:
        block_n = max(16, block_n // 2)
    return AttentionConfig(block_m, block_n, splits, num_warps, num_stages)


def paged_attention_triton(
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
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Triton paged attention; same contract as `loramux.kernels.paged_attention`. `config`
    overrides the heuristic launch shape (tests, benchmarks). Rows of q past query_start_loc[B]
    are not written."""
    T, B, H, hkv, D = check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                            sliding_window, softcap, out)
    if D > MAX_HEAD_DIM:
        raise ValueError(f"paged_attention: head_dim {D} is above the Triton kernel's {MAX_HEAD_DIM}; "
                         "use the torch reference (LORAMUX_KERNELS=torch)")
    result = out if out is not None else torch.empty_like(q)
    if T == 0 or B == 0:
        return result
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]
    G = H // hkv
    cfg = config or attention_config(T, B, H, hkv, D, max_blocks, block_size, q.dtype, q.device)
    if cfg.block_m < max(16, G) or cfg.block_m & (cfg.block_m - 1) or cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"paged_attention: bad config {cfg}: block_m must be a power of two >= max(16, G={G}), "
                         "block_n a power of two >= 16")
    block_q = cfg.block_m // G
    splits = max(1, cfg.num_splits)
    if splits > 1:
        part = torch.empty(T, H, splits, D, dtype=torch.float32, device=q.device)  # [T, H, S, D]
        lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)  # [T, H, S]
        target, st_target, st_lse = part, part.stride(), lse.stride()
    else:
        target, lse = result, result  # lse unused
        st_target = (result.stride(0), result.stride(1), 0, result.stride(2))
        st_lse = (0, 0)
    if softcap is None:
        score_scale, softcap_log2 = scale * LOG2E, 1.0
    else:
        score_scale, softcap_log2 = scale / softcap, softcap * LOG2E
    d_pad = max(16, next_pow2(D))
    sq, sk, sv, sbt = q.stride(), k_cache.stride(), v_cache.stride(), block_tables.stride()
    grid = (T // block_q + B, hkv, splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, target, lse,
        B, max_blocks, num_blocks, score_scale, softcap_log2, sliding_window or 0,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sk[3], sv[0], sv[1], sv[2], sv[3], sbt[0], sbt[1],
        st_target[0], st_target[1], st_target[2], st_target[3], st_lse[0], st_lse[1],
        G=G, HEAD_DIM=D, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n, SEQ_PAD=max(16, next_pow2(B)), NUM_SPLITS=splits,
        MIN_TILES_PER_SPLIT=max(1, cfg.split_min_keys // cfg.block_n),
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None, PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        so = result.stride()
        _merge_splits_kernel[(T, H)](
            part, lse, result, query_start_loc, B,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), so[0], so[1], so[2],
            NUM_SPLITS=splits, SPLIT_PAD=max(2, next_pow2(splits)), HEAD_DIM=D, D_PAD=next_pow2(D),
            num_warps=4 if D >= 128 else 2,
        )
    return result
