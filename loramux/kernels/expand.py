"""Multi-LoRA expand (Triton): y[:, slice_i] += buf[:, slice_i ranks] @ B[slot, slice_i].T for every
slice of a packed module in one launch.

Work items (tile-major): live tiles x column chunks. A tile is up to BLOCK_M tokens of one
slot's segment, live when the slot has a rank on this module; a chunk is `group` blocks of
BLOCK_N columns inside one slice. An item loads its buf tile once (the whole rank), then walks
its chunk block by block with the next blocks' y and B already in flight (async copies,
`num_stages` deep), so y streams through at memory speed. Rows of tokens without an adapter are
never touched, nor are rows of a slot whose rank is 0 for this module.

The grid's programs loop over the items with its stride (`loramux.kernels.tiles.looped_grid`).
For a static meta its shape comes from T and the module's shape only (`static_expand_config`),
so one CUDA graph serves every mapping.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_expand
from .metadata import LoRABatchMeta
from .pool import POOL_ROW_ALIGN
from .tiles import (DECODE_MAX_TOKENS, POOL_ALIGN, STATIC_DECODE_FILL, block_m_for, cdiv, dot_precision,
                    live_segments, looped_grid, next_pow2, pool_width, resolve_pdl, shape_from_tokens_alone,
                    slot_lanes, static_block_m, target_programs, tile_at)


# token-count-dependent ints are not specialized: a batch flipping between 1 and 2 adapters must not recompile
@triton.jit(do_not_specialize=["num_active", "n_slices", "n_units", "group"])
def _expand_kernel(
    y_ptr, buf_ptr, b_ptr, ranks_ptr, pool_ptr, slice_tab_ptr, scales_ptr,
    sorted_ids_ptr, counts_ptr, starts_ptr, slots_ptr, num_active,
    n_slices, R, n_units, group,
    stride_ym, stride_yn, stride_bm, stride_bk, stride_ws, stride_wn, stride_wk, stride_ss, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    A_PAD: tl.constexpr, SL_PAD: tl.constexpr,
    HAS_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr, CAST_BUF: tl.constexpr, PRECISION: tl.constexpr,
    Y_VEC: tl.constexpr, W_VEC: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr, PAGED: tl.constexpr,
    STORE: tl.constexpr,
):
    # STORE: y's rows of tokens with an adapter touching the module are overwritten with the delta
    # (zeros in the slices it does not target) and never read: y is a delta buffer of its own
    # USE_PDL (launched with programmatic dependent launch): the program may start while the
    # kernels just before it (the base GEMM, the shrink) still run. Until `gdc_wait` it reads only
    # what was written before those kernels started (the step's meta, the slice table, the slot
    # ranks): they start only once everything before them has completed, being launched normally
    # or being this kernel, which waits in every program. buf and y come after the wait. Every
    # program waits, so this kernel never completes before its predecessors do: a later kernel
    # launched normally sees them completed, as without PDL.
    cnt, sts, sls, rks, ntile, cum = live_segments(counts_ptr, starts_ptr, slots_ptr, ranks_ptr, num_active,
                                                   BLOCK_M, A_PAD, HAS_RANKS)
    # slice table: [2, SL_PAD] int32 = (sizes, offsets)
    s_idx = tl.arange(0, SL_PAD)
    sizes = tl.load(slice_tab_ptr + s_idx, mask=s_idx < n_slices, other=0)
    offsets = tl.load(slice_tab_ptr + SL_PAD + s_idx, mask=s_idx < n_slices, other=0)
    chunk = BLOCK_N * group
    n_chunks = (sizes + chunk - 1) // chunk
    chunk_cum = tl.cumsum(n_chunks, 0)
    if USE_PDL:  # buf (the shrink's) and y (the base GEMM's) are read only past this point
        tl.extra.cuda.gdc_wait()
    # work items, tile-major: (live tile, column chunk); the grid strides over them
    for item in range(tl.program_id(0), tl.sum(ntile, 0) * n_units, tl.num_programs(0)):
        unit = item % n_units
        slot, rank, start, count, m0 = tile_at(item // n_units, cnt, sts, sls, rks, ntile, cum, BLOCK_M, A_PAD)
        if HAS_RANKS:
            rank = tl.minimum(rank, R)
        else:
            rank = R
        # this unit's slice and chunk
        i = tl.sum((chunk_cum <= unit).to(tl.int32), 0)
        sel = s_idx == i
        c0 = (unit - tl.sum(tl.where(sel, chunk_cum - n_chunks, 0), 0)) * chunk  # first column in the slice
        n_i = tl.sum(tl.where(sel, sizes, 0), 0)
        off_i = tl.sum(tl.where(sel, offsets, 0), 0)
        if Y_VEC > 1:  # slices start and end on 16-byte boundaries: y moves in 16-byte vectors
            off_i = (off_i // Y_VEC) * Y_VEC  # a no-op the compiler's alignment analysis can read
        n_blocks = tl.minimum(tl.cdiv(n_i - c0, BLOCK_N), group)
        n_end = tl.minimum(n_i, c0 + chunk)  # this item's columns: [c0, n_end) of slice i
        slice_on = True
        if HAS_SCALES:
            # a slice the slot's adapter does not target (scale 0; the shrink left its buf columns
            # zero): its B (zeros) is not read, and y stays as it was (STORE: takes zeros)
            slice_on = tl.load(scales_ptr + slot.to(tl.int64) * stride_ss + i * stride_sn) != 0.0
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        if slice_on:
            tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
            _expand_chunk(y_ptr, buf_ptr, b_ptr, pool_ptr, tok, m_mask, slot, rank, i, R, off_i, c0, n_end,
                          n_blocks, stride_ym, stride_yn, stride_bm, stride_bk, stride_ws, stride_wn, stride_wk,
                          BLOCK_M, BLOCK_N, BLOCK_R, CAST_BUF, PRECISION, Y_VEC, W_VEC, STAGES, PAGED, STORE)
        elif STORE:  # the row of a delta buffer is whole: an untargeted slice's columns are zeros
            tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
            n_loc = c0 + tl.arange(0, BLOCK_N)
            y_ptrs = y_ptr + tok[:, None] * stride_ym + (off_i + n_loc)[None, :] * stride_yn
            for j in range(0, n_blocks):
                y_mask = m_mask[:, None] & (n_loc < n_end)[None, :]
                tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=y_mask)
                n_loc += BLOCK_N
                y_ptrs += BLOCK_N * stride_yn


@triton.jit
def _expand_chunk(y_ptr, buf_ptr, b_ptr, pool_ptr, tok, m_mask, slot, rank, i, R, off_i, c0, n_end, n_blocks,
                  stride_ym, stride_yn, stride_bm, stride_bk, stride_ws, stride_wn, stride_wk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CAST_BUF: tl.constexpr,
                  PRECISION: tl.constexpr, Y_VEC: tl.constexpr, W_VEC: tl.constexpr, STAGES: tl.constexpr,
                  PAGED: tl.constexpr, STORE: tl.constexpr):
    """One work item: columns [c0, n_end) of slice ``i`` (``n_blocks`` blocks) for a tile's
    tokens ``tok``: y += (or, STORE, y =) buf's slice-i ranks @ B[slot]'s columns."""
    offs_r = tl.arange(0, BLOCK_R)
    # buf: [T, n_slices*R] f32, slice i at columns i*R; loaded once, reused for every block
    hb = tl.load(buf_ptr + tok[:, None] * stride_bm + (i * R + offs_r)[None, :] * stride_bk,
                 mask=m_mask[:, None] & (offs_r < rank)[None, :], other=0.0)  # [BM, BR]
    if PAGED:  # the pool: this slot's B is one [N, width] block at element start * N
        width = tl.multiple_of(pool_width(rank), POOL_ALIGN)
        w_base = b_ptr + tl.multiple_of(tl.load(pool_ptr + slot).to(tl.int64) * stride_ws, POOL_ALIGN)
        stride_wn = width
    if W_VEC > 1:
        # B's columns past a slot's rank are zero padding, so reading whole 16-byte vectors is
        # exact; a mask the compiler can prove vector-uniform lets it pipeline B's loads
        rank = ((rank + W_VEC - 1) // W_VEC) * W_VEC
    r_mask = offs_r < rank
    if CAST_BUF:  # 16-bit: round to the weights' dtype for the tensor cores, as PEFT does
        hb = hb.to(b_ptr.dtype.element_ty)
    if Y_VEC > 1:  # a no-op that proves the column mask uniform per vector, so y's loads pipeline
        n_end = (n_end // Y_VEC) * Y_VEC
    n_loc = c0 + tl.arange(0, BLOCK_N)  # [BN] columns of this block within the slice
    if PAGED:
        w_ptrs = w_base + (off_i + n_loc)[:, None] * stride_wn + offs_r[None, :]
    else:  # B[slot]: [N, R]
        w_ptrs = (b_ptr + slot.to(tl.int64) * stride_ws + (off_i + n_loc)[:, None] * stride_wn
                  + offs_r[None, :] * stride_wk)
    # y: [T, N] gathered rows
    y_ptrs = y_ptr + tok[:, None] * stride_ym + (off_i + n_loc)[None, :] * stride_yn
    # an explicit pipeline depth makes the compiler stream y (not only B) through shared memory
    # with async copies, several blocks ahead
    for j in tl.range(0, n_blocks, num_stages=STAGES):
        n_mask = n_loc < n_end
        y_mask = m_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BN, BR]
        if CAST_BUF:
            acc = tl.dot(hb, tl.trans(w))
        else:
            acc = tl.dot(hb, tl.trans(w.to(tl.float32)), input_precision=PRECISION)  # [BM, BN] f32
        if STORE:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            yt = tl.load(y_ptrs, mask=y_mask, other=0.0)  # [BM, BN]
            tl.store(y_ptrs, (yt.to(tl.float32) + acc).to(yt.dtype), mask=y_mask)
        n_loc += BLOCK_N
        w_ptrs += BLOCK_N * stride_wn
        y_ptrs += BLOCK_N * stride_yn


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    group: int  # column blocks per program
    num_warps: int
    num_stages: int
    cast_buf: bool = True  # 16-bit y: buf rounded to the weights' dtype for the product (PEFT does)


def expand_config(meta: LoRABatchMeta, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                  device: torch.device, sms: int | None = None) -> ExpandConfig:
    """Launch shape, cached on the meta; a static meta and a prefill-sized batch get
    `static_expand_config` (`shape_from_tokens_alone`). An eager decode-sized batch: 64-column
    blocks; shorter tiles for small ranks (buf rows are cheap) and taller ones for large ranks
    (fewer re-reads of B from L2); several blocks per program while the grid stays more than twice
    the GPU; sized for ``sms`` multiprocessors when given (`target_programs`)."""
    key = ("expand", slice_sizes, R, dtype, device, sms)
    cfg = meta._cache.get(key)
    if cfg is not None:
        return cfg
    if shape_from_tokens_alone(meta):
        cfg = static_expand_config(meta.num_tokens, slice_sizes, R, dtype, device, sms)
        meta._cache[key] = cfg
        return cfg
    block_m = min(block_m_for(meta), 32 if R <= 32 else 64)
    cfg = _expand_shape(block_m, max(1, meta.num_tiles(block_m)), slice_sizes, target_programs(device, sms))
    meta._cache[key] = cfg
    return cfg


#: A prefill-sized static launch's column blocks and blocks a program (`static_expand_config`).
PREFILL_BLOCK_N, PREFILL_GROUP = 128, 4


def static_expand_config(num_tokens: int, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                         device: torch.device, sms: int | None = None) -> ExpandConfig:
    """Launch shape for a static meta (and a prefill-sized batch), from T and the module's shape
    only. At decode sizes the column split is sized for the one-adapter batch (ceil(T / BLOCK_M)
    tiles), the one that needs the most items per tile; a mixed batch gives the same grid more
    tiles. Prefill-sized launches take fixed 512-column chunks."""
    block_m = min(static_block_m(num_tokens), 32 if R <= 32 else 64)
    # a decode graph's grid has a tile per adapter of the batch, and each program's start (its
    # segment, token ids, buf rows: dependent loads) is paid per tile: its one-adapter grid fills
    # `STATIC_DECODE_FILL` of the target, not twice the target, so a many-adapter batch runs
    # fewer, longer programs: the many-adapter step gains more than the one-adapter step loses
    if num_tokens <= DECODE_MAX_TOKENS:
        return _expand_shape(block_m, max(1, cdiv(num_tokens, block_m)), slice_sizes, target_programs(device, sms),
                             STATIC_DECODE_FILL)
    # prefill-sized: 512 columns a program, whatever the count of tiles. A mixed step's grid holds
    # a short tile per decode adapter beside the prompt chunks' tiles, and each program pays its
    # start (the segment scan, the token ids, the buf tile) once: a split sized for the one
    # adapter's few tiles ran the mixed step's many as many short programs
    return ExpandConfig(block_m, PREFILL_BLOCK_N, PREFILL_GROUP, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=1024)
def _expand_shape(block_m: int, n_tiles: int, slice_sizes: tuple[int, ...], target: int,
                  fill: float = 2) -> ExpandConfig:
    """64-column blocks (32 where too few programs), then ``group`` blocks a program while the
    grid of ``n_tiles`` tiles still holds ``fill`` x ``target`` programs."""
    block_n = 64
    while block_n > 32 and n_tiles * sum(cdiv(n, block_n) for n in slice_sizes) < target:
        block_n //= 2
    group = 1
    while group < 8 and n_tiles * sum(cdiv(n, block_n * group * 2) for n in slice_sizes) >= fill * target:
        group *= 2
    return ExpandConfig(block_m, block_n, group, num_warps=4, num_stages=3 if group > 1 else 2)


_SLICE_TABLES: dict = {}


def _slice_table(slice_sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """(table, pad, offsets): table is [2, pad] int32 flat, slice sizes then offsets; one per
    module shape and device, made once per process."""
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
        hit = (torch.tensor(tab, dtype=torch.int32, device=device), pad, tuple(offs))  # tab: [2, pad] flat
        _SLICE_TABLES[key] = hit
    return hit


def expand_launch(meta: LoRABatchMeta, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                  device: torch.device, config: ExpandConfig | None = None,
                  sms: int | None = None) -> tuple[ExpandConfig, tuple[int], int]:
    """(config, grid, work units per tile) of the launch `lora_expand_triton` makes. For a static
    meta it depends on (T, S, slice sizes, R, dtype, device) only: tests compare it across mappings."""
    cfg = config or expand_config(meta, slice_sizes, R, dtype, device, sms)
    key = ("expand_launch", slice_sizes, cfg, sms)
    hit = meta._cache.get(key)
    if hit is None:  # per step and module shape
        n_units = sum(cdiv(n, cfg.block_n * cfg.group) for n in slice_sizes)
        hit = (cfg, looped_grid(meta, cfg.block_m, n_units, target_programs(device, sms)), n_units)
        meta._cache[key] = hit
    return hit


def lora_expand_triton(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    ranks: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
    pdl: bool | None = None,
    pool_starts: torch.Tensor | None = None,
    sms: int | None = None,
    store: bool = False,
    scales: torch.Tensor | None = None,
) -> None:
    """Triton expand; same contract as `loramux.kernels.lora_expand`. `config` overrides the
    heuristic launch shape (tests and benchmarks); `sms`: the multiprocessors the launch is sized
    for (default: all). `pdl`: launch with programmatic dependent
    launch, so the kernel's launch and prologue overlap the end of the kernels before it on this
    stream; None takes ``LORAMUX_PDL`` (off by default), and it is off wherever PDL is not
    available (`loramux.kernels.tiles.pdl_available`)."""
    slice_sizes = tuple(slice_sizes)
    n_slices, R = check_expand(y, buf, lora_b, slice_sizes, meta, ranks, pool_starts=pool_starts)
    if R == 0:
        return
    cfg, grid, n_units = expand_launch(meta, slice_sizes, R, y.dtype, y.device, config, sms)
    if grid[0] == 0:
        return
    tab, sl_pad, _ = _slice_table(slice_sizes, y.device)
    sy, sb = y.stride(), buf.stride()
    # a pool [U, N] holds each slot's [N, width] block from element start * N: stride_ws is N
    sw = lora_b.stride() if pool_starts is None else (lora_b.shape[1], 0, 1)
    vec = 16 // y.element_size()  # 16-byte vectors of y: aligned base, rows and slices
    y_vec = vec if (sy[1] == 1 and sy[0] % vec == 0 and y.data_ptr() % 16 == 0
                    and all(n % vec == 0 for n in slice_sizes)) else 1
    w_vec = 16 // lora_b.element_size()
    # a pool block's columns are padded with zeros to a multiple of POOL_ROW_ALIGN
    w_vec = w_vec if (sw[2] == 1 and (R % w_vec == 0 if pool_starts is None else POOL_ROW_ALIGN % w_vec == 0)) else 1
    use_pdl = resolve_pdl(pdl, y.device)
    # `launch_pdl` only when on: PDL being available implies this Triton knows the option
    launch_options = {"launch_pdl": True} if use_pdl else {}
    ss = scales.stride() if scales is not None else (0, 0)
    _expand_kernel[grid](
        y, buf, lora_b, ranks if ranks is not None else tab, pool_starts if pool_starts is not None else tab, tab,
        scales if scales is not None else tab,
        meta.sorted_token_ids, meta.active_counts, meta.active_starts, meta.active_slots, meta.num_active,
        n_slices, R, n_units, cfg.group,
        sy[0], sy[1], sb[0], sb[1], sw[0], sw[1], sw[2], ss[0], ss[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=max(16, next_pow2(R)),
        A_PAD=slot_lanes(meta), SL_PAD=sl_pad,
        HAS_RANKS=ranks is not None, HAS_SCALES=scales is not None,
        CAST_BUF=cfg.cast_buf and y.dtype != torch.float32,
        PRECISION=dot_precision(y.dtype), Y_VEC=y_vec, W_VEC=w_vec,
        STAGES=cfg.num_stages, USE_PDL=use_pdl, PAGED=pool_starts is not None,
        STORE=store,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options,
    )
