"""Multi-LoRA shrink (Triton): buf = (x @ A[slot].T) * scale for every slice of a packed module in
one launch, so x is read once.

Work items (tile-major): live tiles x rank blocks x split_k. A tile is up to BLOCK_M tokens of
one slot's segment, live when the slot has a rank on this module; a rank block is BLOCK_N columns
of the n_slices*R stacked ranks. Decode shapes have few tiles, so the K (hidden) dimension is
split across SPLIT_K items. The grid's programs loop over the items with its stride
(`loramux.kernels.tiles.looped_grid`).

Split-K without a zeroed buffer: each split stores its float32 partial product in a scratch
tensor [SPLIT_K, T, NR] (torch.empty, never cleared), then bumps a per-(tile, rank block) counter
in a device-wide table with one acquire-release atomic; the program that finds the count at
SPLIT_K - 1 is the last, sums the partials in split order (deterministic) and stores buf, then
puts the counter back to 0. The table is zeroed once when made and every launch leaves it zero,
so no launch needs a memset before it (one node less per projection in a CUDA graph). buf's
rows of tokens whose slot has a rank here are stored by exactly one item, zeros past the rank;
a rank-0 slot's rows are not (the expand skips that slot).
Launches of the same device share the table: do not run two split-K shrinks at once on
different streams.

Launch shape: from this batch's tiles (`shrink_config`, a decode-sized eager meta), or, for a
static meta and any prefill-sized batch, from T, S and the module's shape alone
(`static_shrink_config`), so the grid is the same for every mapping of T tokens: one CUDA graph
serves any mix of adapters. The split count there is sized for the one-adapter case (the fewest
tiles), which wants the most parallelism in K, and at decode sizes bounds each item's K range; a
mixed batch gives the same grid more items. Eager launches on the whole GPU first look for a
shape tuned on this device model (`loramux.kernels.tuned`, written by scripts/tune_shrink.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_shrink
from .metadata import LoRABatchMeta
from .tiles import (DECODE_MAX_TOKENS, STATIC_DECODE_FILL, block_m_for, cdiv, dot_precision, live_segments,
                    looped_grid, next_pow2, shape_from_tokens_alone, slot_lanes, static_block_m, target_programs,
                    tile_at)
from .tuned import many_adapters, tuned_shrink_config

#: Most K splits of one launch (the last program's reduction loop is unrolled this far).
MAX_SPLIT_K = 64
#: Most K splits of a prefill-sized static launch. Its split is sized for the one-adapter batch,
#: but a mixed step (decodes over many adapters beside prompt chunks) fills the grid with a
#: short tile per decode adapter, each reading its adapter's weights: there the GPU is full
#: without splits, and each split more writes and re-reads partials and waits on a counter.
PREFILL_MAX_SPLIT_K = 4
#: Prefill-sized static launches up to this many tokens take 16-row tiles: a mixed step's tiles
#: of decode adapters (a row or two each) are a large share of its grid there, and 64-row tiles
#: would run those programs mostly masked. Past it the prompt chunks' tiles dominate.
PREFILL_SHORT_TILES_MAX = 1024
#: Widest K range of one program of a decode-sized static launch. A many-adapter batch fills the
#: grid with a one-row tile per adapter, each program a K loop of dependent loads beside the base
#: GEMM, so the longest loop, not the bytes, sets the launch's time; a split sized for the
#: one-adapter grid left K whole in a mixed step's graph (decodes beside a prompt chunk).
DECODE_MAX_K_PER_SPLIT = 1024
#: Counters in a device's split-K table: one per (tile, rank block) of a launch. Split-K launches
#: have a few thousand at most (decode: tiles <= min(S, T) + T / BLOCK_M); a launch needing more
#: runs without split-K.
LOCK_TABLE_SIZE = 1 << 15


# token-count-dependent ints are not specialized: a batch flipping between 1 and 2 adapters must not recompile
@triton.jit(do_not_specialize=["num_active", "k_per_split", "T"])
def _shrink_kernel(
    x_ptr, a_ptr, scales_ptr, ranks_ptr, pool_ptr, buf_ptr, part_ptr, lock_ptr,
    sorted_ids_ptr, counts_ptr, starts_ptr, slots_ptr, num_active,
    T, H, NR, R, k_per_split,
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_ss, stride_sn, stride_bm, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    A_PAD: tl.constexpr, HAS_RANKS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
):
    cnt, sts, sls, rks, ntile, cum = live_segments(counts_ptr, starts_ptr, slots_ptr, ranks_ptr, num_active,
                                                   BLOCK_M, A_PAD, HAS_RANKS)
    n_blocks = tl.cdiv(NR, BLOCK_N)
    per_tile = n_blocks * SPLIT_K
    # work items, tile-major: (live tile, rank block, K split); the grid strides over them
    for item in range(tl.program_id(0), tl.sum(ntile, 0) * per_tile, tl.num_programs(0)):
        pid_m = item // per_tile
        pid_n = (item % per_tile) // SPLIT_K
        pid_k = item % SPLIT_K
        slot, rank, start, count, m0 = tile_at(pid_m, cnt, sts, sls, rks, ntile, cum, BLOCK_M, A_PAD)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = offs_n < NR
        # the scales load beside the token ids (both wait on the slot only), before the K loop: a
        # slice with scale 0 is one the slot's adapter does not target (a q/v adapter's k in a
        # fused qkv): its A rows (zeros) are never read, and a block of such columns stores zeros
        sc = tl.load(scales_ptr + slot.to(tl.int64) * stride_ss + (offs_n // R) * stride_sn, mask=n_in, other=0.0)
        n_mask = n_in & (sc != 0.0)
        if HAS_RANKS:
            n_mask = n_mask & ((offs_n % R) < rank)
        out_mask = m_mask[:, None] & n_in[None, :]
        buf_ptrs = buf_ptr + tok[:, None] * stride_bm + offs_n[None, :] * stride_bn
        if tl.max(n_mask.to(tl.int32), 0) == 0:
            # the whole block is past the slot's rank or off (every split sees the same): split 0
            # stores the zeros, nobody touches the counter
            if pid_k == 0:
                tl.store(buf_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=out_mask)
        else:
            _shrink_block(x_ptr, a_ptr, pool_ptr, buf_ptrs, part_ptr, lock_ptr, tok, slot, offs_n, sc,
                          m_mask, n_mask, out_mask, pid_m * n_blocks + pid_n, pid_k, T, H, NR, R, k_per_split,
                          stride_xm, stride_xk, stride_as, stride_an, stride_ak,
                          BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, EVEN_K, PRECISION, PAGED)


@triton.jit
def _shrink_block(x_ptr, a_ptr, pool_ptr, buf_ptrs, part_ptr, lock_ptr, tok, slot, offs_n, sc,
                  m_mask, n_mask, out_mask, lock_idx, pid_k, T, H, NR, R, k_per_split,
                  stride_xm, stride_xk, stride_as, stride_an, stride_ak,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PAGED: tl.constexpr):
    """One work item: split ``pid_k`` of K for a tile's rank block, into buf (or, split, into
    the partials, the last split of the (tile, block) ``lock_idx`` summing them into buf)."""
    if PAGED:  # the pool [U, n_slices, H]: rank row j of slice i at unit start + j
        a_rows = (tl.load(pool_ptr + slot).to(tl.int64) + offs_n % R) * stride_as + (offs_n // R) * stride_an
    else:  # A[slot]: [NR, H]
        a_rows = slot.to(tl.int64) * stride_as + offs_n * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_hi = tl.minimum(k_lo + k_per_split, H)
    offs_k = tl.arange(0, BLOCK_K)
    # x: [T, H] gathered rows
    x_ptrs = x_ptr + tok[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    a_ptrs = a_ptr + a_rows[:, None] + (k_lo + offs_k)[None, :] * stride_ak
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
    acc = acc * sc[None, :]  # columns past the rank are exact zeros (A masked)
    if SPLIT_K == 1:
        tl.store(buf_ptrs, acc, mask=out_mask)
    else:
        # partials: [SPLIT_K, T, NR] float32, contiguous; rows of this tile's tokens only
        part_off = tok[:, None] * NR + offs_n[None, :]
        tl.store(part_ptr + pid_k * T * NR + part_off, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        lock = lock_ptr + lock_idx
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this (tile, block): reduce, in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: read from L2, where the other programs' partials are (never a stale L1 line)
                total += tl.load(part_ptr + s * T * NR + part_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(buf_ptrs, total, mask=out_mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # leave the table zero for the next launch


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def shrink_config(meta: LoRABatchMeta, NR: int, H: int, dtype: torch.dtype, device: torch.device,
                  sms: int | None = None, rank: int | None = None) -> ShrinkConfig:
    """Launch shape, cached on the meta (every layer of a step reuses it); ``rank``: R, the rank
    columns of each slice of the NR stacked ones (default NR: one slice).

    An eager launch on every multiprocessor (an exact meta, no ``sms``) takes this device's tuned
    shape where one was measured near its token count (`loramux.kernels.tuned`); the rest:

    A static meta and a prefill-sized batch (`shape_from_tokens_alone`) get `static_shrink_config`.
    A decode-sized batch (at most `DECODE_MAX_TOKENS` tokens) is latency bound whatever its mix:
    tiles of its segments' height, narrow rank blocks that spread the weights over many short
    programs (tall tiles and wide blocks leave most of the GPU idle at decode), K split until the
    grid fills the GPU (or ``sms`` of its multiprocessors, `target_programs`).
    """
    key = ("shrink", NR, H, dtype, device, sms, rank)
    cfg = meta._cache.get(key)
    if cfg is not None:
        return cfg
    R = rank or NR
    if not meta.static and not sms:  # an eager launch on every SM: this device's tuned shape, if measured
        tuned = tuned_shrink_config(device, dtype, NR // R, R, H, meta.num_tokens, many_adapters(meta))
        if tuned is not None:
            cfg = meta._cache[key] = ShrinkConfig(**tuned)
            return cfg
    if shape_from_tokens_alone(meta):
        cfg = static_shrink_config(meta.num_tokens, NR, H, dtype, device, sms, rank)
        meta._cache[key] = cfg
        return cfg
    target = target_programs(device, sms)
    block_m = min(block_m_for(meta), static_block_m(meta.num_tokens))
    n_tiles = max(1, meta.num_tiles(block_m))
    block_n, block_k = min(max(16, next_pow2(NR)), 256), 128
    while block_n > 16 and n_tiles * cdiv(NR, block_n) < target:
        block_n //= 2
    if dtype == torch.float32:
        block_k //= 2
    split_k = _split_for(n_tiles * cdiv(NR, block_n), target, H, block_k)
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    cfg = ShrinkConfig(block_m, block_n, block_k, split_k, num_warps, 4)
    meta._cache[key] = cfg
    return cfg


def static_shrink_config(num_tokens: int, NR: int, H: int, dtype: torch.dtype, device: torch.device,
                         sms: int | None = None, rank: int | None = None) -> ShrinkConfig:
    """Launch shape for a static meta: a function of T and the module's shape only (``rank``: R,
    each slice's rank columns; default NR, one slice).

    The split count is chosen for the one-adapter batch (ceil(T / BLOCK_M) tiles), the one that
    needs K split most, at decode sizes to fill `STATIC_DECODE_FILL` of the target (and at least
    into `DECODE_MAX_K_PER_SPLIT`-wide ranges), at prefill sizes at most `PREFILL_MAX_SPLIT_K`
    ways. Many adapters then give the same grid more tiles, each reading its own adapter's
    weights: more items, each as short as in the one-adapter case.
    """
    return _static_shrink_config(num_tokens, NR, H, dtype, target_programs(device, sms), rank or NR)


@functools.lru_cache(maxsize=1024)
def _static_shrink_config(num_tokens: int, NR: int, H: int, dtype: torch.dtype, target: int, R: int) -> ShrinkConfig:
    block_m = static_block_m(num_tokens)
    np2 = min(max(16, next_pow2(NR)), 256)
    if num_tokens <= DECODE_MAX_TOKENS:
        # decode: the weights dominate whatever the mix. Blocks as wide as a slice's R, up to 32:
        # at R = 64, 16-wide blocks fill the one-adapter grid, so K goes unsplit and each program
        # of a many-adapter batch reads all of K; 64-wide blocks leave too few programs
        block_n, block_k = min(max(16, next_pow2(R)), 32), 128
    else:
        block_n, block_k = min(np2, 64), 64
        if num_tokens <= PREFILL_SHORT_TILES_MAX:  # a mixed step's decode tiles are a row or two each
            block_m = 16
    if dtype == torch.float32:
        block_k //= 2
    one_adapter_tiles = max(1, cdiv(num_tokens, block_m))
    if num_tokens <= DECODE_MAX_TOKENS:
        split_k = _split_for(one_adapter_tiles * cdiv(NR, block_n), max(1, int(target * STATIC_DECODE_FILL)), H,
                             block_k, at_least=cdiv(H, DECODE_MAX_K_PER_SPLIT))
    else:
        split_k = min(_split_for(one_adapter_tiles * cdiv(NR, block_n), target, H, block_k), PREFILL_MAX_SPLIT_K)
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    return ShrinkConfig(block_m, block_n, block_k, split_k, num_warps, 4)


def _split_for(programs: int, target: int, H: int, block_k: int, at_least: int = 1) -> int:
    """K splits that bring `programs` up to `target`, and at least ``at_least``; each split
    keeping >= 2 K-steps, at most `MAX_SPLIT_K`."""
    wanted = max(at_least, target // programs if programs < target else 1)
    return max(1, min(wanted, cdiv(H, block_k) // 2, MAX_SPLIT_K))


@dataclass(frozen=True)
class ShrinkLaunch:
    """What one shrink launch runs: its shape, its grid and the K range of each split."""

    config: ShrinkConfig
    grid: tuple[int]
    n_tiles: int  # tiles of the batch (for a static meta: the bound over every mapping)
    split_k: int  # splits that cover K (<= config.split_k: empty splits are dropped)
    k_per_split: int


def shrink_launch(meta: LoRABatchMeta, NR: int, H: int, dtype: torch.dtype, device: torch.device,
                  config: ShrinkConfig | None = None, sms: int | None = None,
                  rank: int | None = None) -> ShrinkLaunch:
    """The launch `lora_shrink_triton` makes for this meta and module shape (``rank``: R per
    slice, default NR). For a static meta it depends on (T, S, NR, R, H, dtype, device, sms)
    only: tests compare it across mappings."""
    cfg = config or shrink_config(meta, NR, H, dtype, device, sms, rank)
    n_tiles = meta.num_tiles(cfg.block_m)
    k_chunks = cdiv(max(H, 1), cfg.block_k)
    k_per_split = cdiv(k_chunks, max(1, min(cfg.split_k, MAX_SPLIT_K))) * cfg.block_k
    split_k = cdiv(max(H, 1), k_per_split)  # drop splits that would be empty
    if n_tiles * cdiv(NR, cfg.block_n) > LOCK_TABLE_SIZE:  # more counters than the table: no split
        split_k, k_per_split = 1, k_chunks * cfg.block_k
    grid = looped_grid(meta, cfg.block_m, cdiv(NR, cfg.block_n) * split_k, target_programs(device, sms))
    return ShrinkLaunch(cfg, grid, n_tiles, split_k, k_per_split)


def _scratch(*shape: int, device: torch.device) -> torch.Tensor:
    """Uninitialised float32 scratch (its own function so tests can hand out poisoned memory)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


_LOCK_TABLES: dict = {}


def _lock_table(device: torch.device) -> torch.Tensor:
    """The device's split-K counters: zeroed once here, left zero by every launch."""
    table = _LOCK_TABLES.get(device)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "lora_shrink: the split-K counter table of this device is made on the first launch, and "
                "this first launch is inside a CUDA graph capture; run the step once before capturing "
                "(a warm-up also compiles the kernels)"
            )
        table = torch.zeros(LOCK_TABLE_SIZE, dtype=torch.int32, device=device)
        _LOCK_TABLES[device] = table
    return table


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scales: torch.Tensor,
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    config: ShrinkConfig | None = None,
    out: torch.Tensor | None = None,
    pool_starts: torch.Tensor | None = None,
    max_rank: int | None = None,
    sms: int | None = None,
) -> torch.Tensor:
    """Triton shrink; same contract as `loramux.kernels.lora_shrink`. `config` overrides the
    heuristic launch shape (tests and benchmarks); `out` ([T, n_slices*R] float32) receives buf;
    `sms`: the multiprocessors the launch is sized for (default: all).
    Neither buf nor any scratch is zeroed: every launch is a single kernel."""
    n_slices, R = check_shrink(x, lora_a, scales, meta, ranks, pool_starts=pool_starts, max_rank=max_rank)
    T, H = x.shape
    NR = n_slices * R
    if out is None:
        buf = _scratch(T, NR, device=x.device)  # [T, NR]
    else:
        if out.shape != (T, NR) or out.dtype != torch.float32 or out.device != x.device:
            raise ValueError(f"lora_shrink: out must be a float32 [{T}, {NR}] tensor on {x.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        buf = out
    if NR == 0 or T == 0:
        return buf
    launch = shrink_launch(meta, NR, H, x.dtype, x.device, config, sms, rank=R)
    if launch.n_tiles == 0:
        return buf
    cfg = launch.config
    if launch.split_k > 1:
        parts = _scratch(launch.split_k, T, NR, device=x.device)  # [SPLIT, T, NR], never cleared
        locks = _lock_table(x.device)
    else:
        parts = locks = buf  # unused
    sx, sa, ss, sb = x.stride(), lora_a.stride(), scales.stride(), buf.stride()
    _shrink_kernel[launch.grid](
        x, lora_a, scales, ranks if ranks is not None else scales, pool_starts if pool_starts is not None else scales,
        buf, parts, locks,
        meta.sorted_token_ids, meta.active_counts, meta.active_starts, meta.active_slots, meta.num_active,
        T, H, NR, R, launch.k_per_split,
        sx[0], sx[1], sa[0], sa[1], sa[2], ss[0], ss[1], sb[0], sb[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=launch.split_k,
        A_PAD=slot_lanes(meta), HAS_RANKS=ranks is not None, EVEN_K=H % cfg.block_k == 0,
        PRECISION=dot_precision(x.dtype), PAGED=pool_starts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return buf
