"""Multi-LoRA shrink (Triton): buf = (x @ A[slot].T) * scale for every slice of a packed module in
one launch, so x is read once.

Grid: (tiles x rank blocks, split_k). A tile is up to BLOCK_M tokens of one slot's segment; a rank
block is BLOCK_N columns of the n_slices*R stacked ranks. Decode shapes have few tiles, so the K
(hidden) dimension is split across programs that add into a zeroed buf with float32 atomics; the
split count falls smoothly as tokens grow (no fixed token threshold, so no cliff).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_shrink
from .metadata import LoRABatchMeta
from .tiles import block_m_for, cdiv, dot_precision, next_pow2, segment_tile, target_programs


# token-count-dependent ints are not specialized: a batch flipping between 1 and 2 adapters must not recompile
@triton.jit(do_not_specialize=["num_active", "k_per_split"])
def _shrink_kernel(
    x_ptr, a_ptr, scales_ptr, ranks_ptr, buf_ptr,
    sorted_ids_ptr, counts_ptr, starts_ptr, slots_ptr, num_active,
    H, NR, R, k_per_split,
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_ss, stride_sn, stride_bm, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_PAD: tl.constexpr,
    HAS_RANKS: tl.constexpr, EVEN_K: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_blocks = tl.cdiv(NR, BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    slot, start, count, m0 = segment_tile(pid_m, counts_ptr, starts_ptr, slots_ptr, num_active, BLOCK_M, A_PAD)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NR
    if HAS_RANKS:
        rank = tl.load(ranks_ptr + slot)
        n_mask = n_mask & ((offs_n % R) < rank)
    # whole block past the slot's rank, or a tile past the batch's last one: no loads
    n_live = (tl.max(n_mask.to(tl.int32), 0) > 0) & (count > m0)

    slot64 = slot.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_hi = tl.minimum(k_lo + k_per_split, H)
    k_hi = tl.where(n_live, k_hi, k_lo)
    offs_k = tl.arange(0, BLOCK_K)
    # x: [T, H] gathered rows; A[slot]: [NR, H]
    x_ptrs = x_ptr + tok[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    a_ptrs = a_ptr + slot64 * stride_as + offs_n[:, None] * stride_an + (k_lo + offs_k)[None, :] * stride_ak
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)  # [BM, BK]
            at = tl.load(a_ptrs, mask=n_mask[:, None], other=0.0)  # [BN, BK]
        else:
            k_mask = (k + offs_k) < k_hi
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(at), input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    sc = tl.load(scales_ptr + slot64 * stride_ss + (offs_n // R) * stride_sn, mask=offs_n < NR, other=0.0)
    acc = acc * sc[None, :]
    out_ptrs = buf_ptr + tok[:, None] * stride_bm + offs_n[None, :] * stride_bn
    out_mask = m_mask[:, None] & (offs_n < NR)[None, :]
    if ATOMIC:
        # buf was zeroed: columns past the slot's rank need no atomics
        tl.atomic_add(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")
    else:
        tl.store(out_ptrs, acc, mask=out_mask)  # columns past the rank get exact zeros


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def shrink_config(meta: LoRABatchMeta, NR: int, H: int, dtype: torch.dtype, device: torch.device) -> ShrinkConfig:
    """Heuristic launch shape, cached on the meta (every layer of a step reuses it).

    Weights dominate the bytes (decode: few tokens per slot): narrow rank blocks spread the
    weights over programs. Activations dominate (prefill): 64-wide rank blocks, whose programs
    for one tile run side by side, so x comes from DRAM once and from L2 after. Either way, K is
    split until the grid fills the GPU; the split shrinks smoothly as tokens grow.
    """
    key = ("shrink", NR, H, dtype, device)
    cfg = meta._cache.get(key)
    if cfg is not None:
        return cfg
    target = target_programs(device)
    block_m = block_m_for(meta)
    n_tiles = max(1, meta.num_tiles(block_m))
    np2 = min(max(16, next_pow2(NR)), 256)
    if meta.num_active * NR >= meta.num_lora_tokens:  # weights dominate
        block_n, block_k, num_stages = np2, 128, 4
        while block_n > 16 and n_tiles * cdiv(NR, block_n) < target:
            block_n //= 2
    else:  # activations dominate: 64-wide rank blocks (wgmma m64n64) re-read x from L2, not DRAM
        block_n, block_k, num_stages = min(np2, 64), 64, 4
    if dtype == torch.float32:
        block_k //= 2
    base = n_tiles * cdiv(NR, block_n)
    split_k = 1
    if base < target:  # each split keeps >= 2 K-steps
        split_k = max(1, min(target // base, cdiv(H, block_k) // 2))
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    cfg = ShrinkConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)
    meta._cache[key] = cfg
    return cfg


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scales: torch.Tensor,
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    config: ShrinkConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton shrink; same contract as `loramux.kernels.lora_shrink`. `config` overrides the
    heuristic launch shape (tests and benchmarks); `out` ([T, n_slices*R] float32) receives buf."""
    n_slices, R = check_shrink(x, lora_a, scales, meta, ranks)
    T, H = x.shape
    NR = n_slices * R
    cfg = config or shrink_config(meta, NR, H, x.dtype, x.device)
    n_tiles = meta.num_tiles(cfg.block_m)
    k_chunks = cdiv(max(H, 1), cfg.block_k)
    k_per_split = cdiv(k_chunks, cfg.split_k) * cfg.block_k
    split_k = cdiv(max(H, 1), k_per_split)  # drop splits that would be empty
    atomic = split_k > 1
    if out is None:
        buf = (torch.zeros if atomic else torch.empty)(T, NR, dtype=torch.float32, device=x.device)  # [T, NR]
    else:
        if out.shape != (T, NR) or out.dtype != torch.float32 or out.device != x.device:
            raise ValueError(f"lora_shrink: out must be a float32 [{T}, {NR}] tensor on {x.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        buf = out
        if atomic:
            buf.zero_()
    if n_tiles == 0 or NR == 0:
        return buf
    grid = (n_tiles * cdiv(NR, cfg.block_n), split_k)
    sx, sa, ss, sb = x.stride(), lora_a.stride(), scales.stride(), buf.stride()
    _shrink_kernel[grid](
        x, lora_a, scales, ranks if ranks is not None else scales, buf,
        meta.sorted_token_ids, meta.active_counts, meta.active_starts, meta.active_slots, meta.num_active,
        H, NR, R, k_per_split,
        sx[0], sx[1], sa[0], sa[1], sa[2], ss[0], ss[1], sb[0], sb[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, A_PAD=max(32, next_pow2(meta.num_slots)),
        HAS_RANKS=ranks is not None, EVEN_K=H % cfg.block_k == 0,
        ATOMIC=atomic, PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return buf
