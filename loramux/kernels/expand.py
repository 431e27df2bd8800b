"""Multi-LoRA expand (Triton): y[:, slice_i] += buf[:, slice_i ranks] @ B[slot, slice_i].T for every
slice of a packed module in one launch.

Grid: tiles x output blocks. A tile is up to BLOCK_M tokens of one slot's segment; output blocks
are BLOCK_N columns of one slice (blocks never straddle slices, so each reads one rank slice of
buf). y is read and written once, in place; rows of tokens without an adapter are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_expand
from .metadata import LoRABatchMeta
from .tiles import block_m_for, dot_precision, next_pow2, segment_tile, target_programs


@triton.jit
def _expand_kernel(
    y_ptr, buf_ptr, b_ptr, ranks_ptr, slice_tab_ptr,
    sorted_ids_ptr, counts_ptr, starts_ptr, slots_ptr, num_active,
    n_slices, R, n_out_blocks,
    stride_ym, stride_yn, stride_bm, stride_bk, stride_ws, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_PAD: tl.constexpr, SL_PAD: tl.constexpr,
    HAS_RANKS: tl.constexpr, CAST_BUF: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid // n_out_blocks
    pid_nb = pid % n_out_blocks
    slot, start, count, m0 = segment_tile(pid_m, counts_ptr, starts_ptr, slots_ptr, num_active, BLOCK_M, A_PAD)

    # slice table: [2, SL_PAD] int32 = (sizes, offsets); find this block's slice
    s_idx = tl.arange(0, SL_PAD)
    sizes = tl.load(slice_tab_ptr + s_idx, mask=s_idx < n_slices, other=0)
    offsets = tl.load(slice_tab_ptr + SL_PAD + s_idx, mask=s_idx < n_slices, other=0)
    nb = (sizes + BLOCK_N - 1) // BLOCK_N
    cum = tl.cumsum(nb, 0)
    i = tl.sum((cum <= pid_nb).to(tl.int32), 0)
    sel = s_idx == i
    first_block = tl.sum(tl.where(sel, cum - nb, 0), 0)
    n_i = tl.sum(tl.where(sel, sizes, 0), 0)
    off_i = tl.sum(tl.where(sel, offsets, 0), 0)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    n_local = (pid_nb - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_local < n_i
    cols = off_i + n_local  # [BN] columns of y and rows of B[slot]
    mn_mask = m_mask[:, None] & n_mask[None, :]

    # y: [T, N] gathered rows; issued first so its latency hides behind the product
    y_ptrs = y_ptr + tok[:, None] * stride_ym + cols[None, :] * stride_yn
    yt = tl.load(y_ptrs, mask=mn_mask, other=0.0)

    rank = R
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot).to(tl.int32), R)
    slot64 = slot.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # buf: [T, n_slices*R] f32, slice i at columns i*R; B[slot]: [N, R]
    buf_ptrs = buf_ptr + tok[:, None] * stride_bm + (i * R + offs_k)[None, :] * stride_bk
    w_ptrs = b_ptr + slot64 * stride_ws + cols[:, None] * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, rank, BLOCK_K):
        k_mask = (k + offs_k) < rank
        bt = tl.load(buf_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] f32
        wt = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        if CAST_BUF:
            acc += tl.dot(bt.to(wt.dtype), tl.trans(wt))
        else:
            acc += tl.dot(bt, tl.trans(wt.to(tl.float32)), input_precision=PRECISION)
        buf_ptrs += BLOCK_K * stride_bk
        w_ptrs += BLOCK_K * stride_wk

    out = (yt.to(tl.float32) + acc).to(yt.dtype)
    tl.store(y_ptrs, out, mask=mn_mask)


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    cast_buf: bool = False  # 16-bit: round buf to the weights' dtype for the product (PEFT does)


def expand_config(meta: LoRABatchMeta, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                  device: torch.device) -> ExpandConfig:
    """Heuristic launch shape: wide output blocks when there are many tiles (prefill streams y),
    narrower ones when few tiles must still fill the GPU (decode reads B)."""
    block_m = block_m_for(meta)
    n_tiles = max(1, meta.num_tiles(block_m))
    target = target_programs(device)
    block_n = 128
    while block_n > 32 and n_tiles * sum(triton.cdiv(n, block_n) for n in slice_sizes) < target:
        block_n //= 2
    block_k = min(max(16, next_pow2(R)), 64)
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    return ExpandConfig(block_m, block_n, block_k, num_warps, num_stages=2)


_SLICE_TABLES: dict = {}


def _slice_table(slice_sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    key = (slice_sizes, device)
    hit = _SLICE_TABLES.get(key)
    if hit is None:
        pad = max(2, next_pow2(len(slice_sizes)))
        offs = [0]
        for n in slice_sizes[:-1]:
            offs.append(offs[-1] + n)
        tab = [0] * (2 * pad)
        tab[: len(slice_sizes)] = slice_sizes
        tab[pad : pad + len(slice_sizes)] = offs
        hit = (torch.tensor(tab, dtype=torch.int32, device=device), pad)  # [2, pad] flat
        _SLICE_TABLES[key] = hit
    return hit


def lora_expand_triton(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
) -> None:
    """Triton expand; same contract as `loramux.kernels.lora_expand`. `config` overrides the
    heuristic launch shape (tests and benchmarks)."""
    slice_sizes = tuple(slice_sizes)
    n_slices, R = check_expand(y, buf, lora_b, slice_sizes, meta, ranks)
    cfg = config or expand_config(meta, slice_sizes, R, y.dtype, y.device)
    n_tiles = meta.num_tiles(cfg.block_m)
    if n_tiles == 0 or R == 0:
        return
    tab, sl_pad = _slice_table(slice_sizes, y.device)
    n_out_blocks = sum(triton.cdiv(n, cfg.block_n) for n in slice_sizes)
    grid = (n_tiles * n_out_blocks,)
    _expand_kernel[grid](
        y, buf, lora_b, ranks if ranks is not None else tab, tab,
        meta.sorted_token_ids, meta.active_counts, meta.active_starts, meta.active_slots, meta.num_active,
        n_slices, R, n_out_blocks,
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        A_PAD=max(2, next_pow2(meta.num_slots)), SL_PAD=sl_pad,
        HAS_RANKS=ranks is not None, CAST_BUF=cfg.cast_buf and y.dtype != torch.float32,
        PRECISION=dot_precision(y.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
