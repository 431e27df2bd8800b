"""Fused multi-LoRA decode kernel (Triton): y[t, slice i] += scale[slot, i] * B[slot, i](A[slot, i] x[t])
for every slice of a packed module, in ONE launch (issue 13).

At decode the two-kernel path (shrink, then expand) costs two dependent launches of ~5 us each
per module, for ~1 us of bytes: latency, not bandwidth. This kernel runs both halves in one grid.

Why not recompute the rank-R shrink in every output-column program: each program would read its
token tile of x and its slot's A slice over all of H (16 x 4096 + 16 x 4096 bf16 = 256 KB) and do
that serially in K. A few hundred such programs move tens of MB through L2 and each takes several
us. So the shrink is split over K as in `shrink.py`, and shared:

Grid (linear; for a static meta from T, S and the module's shape only, `fused_config.py`): it
holds `tile_slots` tile slots, and slot g serves tiles g, g + tile_slots, ... of this batch. Each
slot has ``n_slices * SPLIT_K`` producers and ``n_units`` consumers (column chunks of all
slices). Programs are laid out by the slots this batch uses, read on the device: their
producers first, then their consumers, then idle programs, which exit after one round of loads.

- A producer (tile, slice i, split k) computes x_tile @ A[slot, slice i, K range].T, stores the
  float32 partial in scratch ``[SPLIT_K, T, n_slices*R]`` (torch.empty, never cleared), and bumps
  the (tile, slice) *ready* counter with a release atomic. It never waits.
- A consumer (tile, column chunk of slice i) first issues its loads of y and B, then waits until
  the ready counter reaches SPLIT_K (volatile spin, then one acquire atomic), sums the SPLIT_K
  partials in split order, scales, rounds to the weights' dtype (16-bit, as PEFT does) and adds
  ``hb @ B.T`` into y.

Deadlock: a consumer waits only for producers, producers wait for nothing, and producers have
the lowest program ids. Hardware dispatches blocks in id order in practice, but CUDA does not
promise it (nor that all programs are resident), so the wait is bounded: after `SPIN_LIMIT`
polls a consumer computes the SPLIT_K partials itself, with the producers' code, and sums them
in the same order, so no schedule can hang the kernel. That cold path steps K by
`FALLBACK_BLOCK_K` (32) to keep the kernel's registers down: with BLOCK_K <= 32 it gives the same
bits as the shared path (the tests check it with SPIN_LIMIT=0), with deeper K steps the same
result up to float32 rounding of the partial sums.

No memset: a second counter per (tile, slice) counts departures (SPLIT_K producers + the slice's
consumers); the last to depart puts both counters back to 0. The per-device counter table is
zeroed once when made (never inside a capture) and every launch leaves it zero. Launches on one
device share it: do not run two fused launches at once on different streams.

Early exits, each read the same way by every program of a (tile, slice), so the counters stay
balanced: every slot rank 0 (the module is targeted by no resident adapter: the whole grid exits
after its first load), the tile's slot has rank 0 here, or the slice's scale is 0 (an adapter
that skips a sibling: `BaseLayerWithLoRA.set_lora` stores scale 0 there). Rows of slot -1
tokens and of skipped slots/slices are never written.

Launch shape: from T and the module's shape only for a static meta (`static_fused_config`), so
one CUDA graph serves any mix of adapters; `lora_apply` uses this kernel up to
`fused_max_tokens()` tokens and the two-kernel path above (prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fused_config as shapes
from .checks import check_apply
from .fused_config import (FUSED_MAX_TOKENS_ENV, FusedConfig, FusedLaunch, fused_config, fused_fits,
                           fused_launch, fused_max_tokens, static_fused_config)
from .metadata import LoRABatchMeta
from .tiles import cdiv, dot_precision, next_pow2

__all__ = ["lora_fused_triton", "SPIN_LIMIT", "FALLBACK_BLOCK_K",
           # launch shapes and the threshold, from fused_config.py
           "FusedConfig", "FusedLaunch", "fused_config", "static_fused_config", "fused_launch", "fused_fits",
           "fused_max_tokens", "FUSED_MAX_TOKENS_ENV"]

#: Polls of a consumer before it computes the shrink itself (a few ms on a GPU; never reached
#: when blocks are dispatched in order, as they are in practice).
SPIN_LIMIT = 1 << 14
#: K step of a consumer that computes the shrink itself (a cold path; small, so it costs no registers).
FALLBACK_BLOCK_K = 32


@triton.jit
def _shrink_partial(x_ptr, a_ptr, tok, m_mask, a_rows, r_mask, k_lo, k_hi, stride_xm, stride_xk, stride_an,
                    stride_ak, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """x[tok, k_lo:k_hi] @ A[a_rows, k_lo:k_hi].T -> [BM, BR] float32 (a_ptr: A[slot]). The one
    code both producers and a timed-out consumer run, so their partials are the same bits."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk  # [BM, BK]
    a_ptrs = a_ptr + a_rows[:, None] * stride_an + (k_lo + offs_k)[None, :] * stride_ak  # [BR, BK]
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < k_hi
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(at), input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    return acc


@triton.jit
def _tile_at(pid_m, a_idx, cum, ntile, cnt, sls, sts, s_idx, all_ranks, R, BLOCK_M: tl.constexpr):
    """Tile pid_m of this batch -> (first row in its segment, segment length, slot, segment start
    in the sorted ids, the slot's rank here); tiles are numbered slot after slot (`tiles.segment_tile`)."""
    a = tl.sum((cum <= pid_m).to(tl.int32), 0)
    sel = a_idx == a
    m0 = (pid_m - tl.sum(tl.where(sel, cum - ntile, 0), 0)) * BLOCK_M
    count = tl.sum(tl.where(sel, cnt, 0), 0)
    slot = tl.sum(tl.where(sel, sls, 0), 0)
    start = tl.sum(tl.where(sel, sts, 0), 0)
    rank = tl.minimum(tl.sum(tl.where(s_idx == slot, all_ranks, 0), 0).to(tl.int32), R)
    return m0, count, slot, start, rank


# token- and mix-dependent ints are not specialized: a batch flipping between 1 and 2 adapters must not recompile
@triton.jit(do_not_specialize=["num_active", "T", "k_per_split", "n_slices", "n_units", "group", "tile_slots"])
def _fused_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, scales_ptr, ranks_ptr, part_ptr, sync_ptr, slice_tab_ptr,
    sorted_ids_ptr, counts_ptr, starts_ptr, slots_ptr, num_active,
    T, H, S, n_slices, R, k_per_split, n_units, group, tile_slots,
    stride_ym, stride_yn, stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_ss, stride_sn,
    stride_ws, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, A_PAD: tl.constexpr, S_PAD: tl.constexpr, SL_PAD: tl.constexpr,
    SYNC_PAIRS: tl.constexpr, HAS_RANKS: tl.constexpr, EVEN_K: tl.constexpr, CAST_BUF: tl.constexpr,
    PRECISION: tl.constexpr, Y_VEC: tl.constexpr, W_VEC: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    FALLBACK_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    # one round of independent loads: the slot ranks and the segment vectors
    a_idx = tl.arange(0, A_PAD)
    real = a_idx < num_active
    cnt = tl.load(counts_ptr + a_idx, mask=real, other=0)  # [A_PAD]
    sts = tl.load(starts_ptr + a_idx, mask=real, other=0)
    sls = tl.load(slots_ptr + a_idx, mask=real, other=0)
    s_idx = tl.arange(0, S_PAD)
    if HAS_RANKS:
        all_ranks = tl.load(ranks_ptr + s_idx, mask=s_idx < S, other=0)  # [S_PAD]
        if tl.max(all_ranks, 0) <= 0:  # no resident adapter targets this module: the grid exits here
            return
    else:
        all_ranks = tl.zeros((S_PAD,), dtype=tl.int32) + R
    ntile = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(ntile, 0)  # inclusive
    n_real = tl.sum(ntile, 0)  # this batch's tiles (the grid was sized from a bound)
    # the grid holds `tile_slots` tile slots; slot g serves tiles g, g + tile_slots, ... Roles are
    # laid out by the slots in use: their producers, then their consumers, then idle programs
    used = tl.minimum(n_real, tile_slots)
    n_prod = used * n_slices * SPLIT_K
    # slice table: [3, SL_PAD] int32 = (sizes, offsets, consumer units per slice)
    sl = tl.arange(0, SL_PAD)
    sl_mask = sl < n_slices
    units = tl.load(slice_tab_ptr + 2 * SL_PAD + sl, mask=sl_mask, other=0)
    NR = n_slices * R
    offs_r = tl.arange(0, BLOCK_R)
    # Each role runs its own tile loop: what one role keeps in registers is never live in the other
    if pid < n_prod:
        # producer (tile slot g, slice i, K split pid_k), slot-major
        g = pid // (n_slices * SPLIT_K)
        i = (pid // SPLIT_K) % n_slices
        pid_k = pid % SPLIT_K
        n_depart = SPLIT_K + tl.sum(tl.where(sl == i, units, 0), 0)  # producers + consumers of a (tile, slice)
        k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
        k_hi = tl.minimum(k_lo + k_per_split, H)
        a_rows = i * R + offs_r  # rows of slice i in A[slot]: [n_slices*R, H]
        for pid_m in range(g, n_real, tile_slots):
            m0, count, slot, start, rank = _tile_at(pid_m, a_idx, cum, ntile, cnt, sls, sts, s_idx, all_ranks, R,
                                                    BLOCK_M)
            slot64 = slot.to(tl.int64)
            sc = tl.load(scales_ptr + slot64 * stride_ss + i * stride_sn)
            # rank 0: the slot's adapter does not touch this module; scale 0: it skips this slice (a
            # sibling it was not trained on). Every program of the (tile, slice) skips alike.
            if (rank > 0) & (sc != 0.0):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_mask = offs_m < count
                tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
                acc = _shrink_partial(x_ptr, a_ptr + slot64 * stride_as, tok, m_mask, a_rows, offs_r < rank,
                                      k_lo, k_hi, stride_xm, stride_xk, stride_an, stride_ak, BLOCK_M, BLOCK_R,
                                      BLOCK_K, EVEN_K, PRECISION)
                # partials: [SPLIT_K, T, NR] float32; rows of this tile's tokens, slice i's columns
                part_ptrs = part_ptr + pid_k * T * NR + tok[:, None] * NR + (i * R + offs_r)[None, :]
                tl.store(part_ptrs, acc, mask=m_mask[:, None] & (offs_r < R)[None, :])
                tl.debug_barrier()  # every thread's partial is written before the release below
                pair = pid_m * n_slices + i
                tl.atomic_add(sync_ptr + pair, 1, sem="release", scope="gpu")
                left = tl.atomic_add(sync_ptr + SYNC_PAIRS + pair, 1, sem="acq_rel", scope="gpu")
                if left == n_depart - 1:  # the last of this (tile, slice) to leave: counters back to 0
                    tl.atomic_xchg(sync_ptr + pair, 0, sem="relaxed", scope="gpu")
                    tl.atomic_xchg(sync_ptr + SYNC_PAIRS + pair, 0, sem="relaxed", scope="gpu")
    else:
        # consumer (tile slot g, column chunk `unit` of all slices), slot-major
        q = pid - n_prod
        g = q // n_units
        if g < used:  # else an idle program: nothing to do
            unit = q % n_units
            sizes = tl.load(slice_tab_ptr + sl, mask=sl_mask, other=0)
            offsets = tl.load(slice_tab_ptr + SL_PAD + sl, mask=sl_mask, other=0)
            ucum = tl.cumsum(units, 0)
            i = tl.sum((ucum <= unit).to(tl.int32), 0)
            isel = sl == i
            n_depart = SPLIT_K + tl.sum(tl.where(isel, units, 0), 0)
            # this program's columns: [c0, n_end) of slice i, which starts at column off_i of y
            chunk = BLOCK_N * group
            c0 = (unit - tl.sum(tl.where(isel, ucum - units, 0), 0)) * chunk
            n_i = tl.sum(tl.where(isel, sizes, 0), 0)
            off_i = tl.sum(tl.where(isel, offsets, 0), 0)
            if Y_VEC > 1:  # slices start and end on 16-byte boundaries: y moves in 16-byte vectors
                off_i = (off_i // Y_VEC) * Y_VEC  # a no-op the compiler's alignment analysis can read
            n_blocks = tl.minimum(tl.cdiv(n_i - c0, BLOCK_N), group)
            n_end = tl.minimum(n_i, c0 + chunk)
            if Y_VEC > 1:
                n_end = (n_end // Y_VEC) * Y_VEC
            a_rows = i * R + offs_r
            for pid_m in range(g, n_real, tile_slots):
                m0, count, slot, start, rank = _tile_at(pid_m, a_idx, cum, ntile, cnt, sls, sts, s_idx, all_ranks,
                                                        R, BLOCK_M)
                slot64 = slot.to(tl.int64)
                sc = tl.load(scales_ptr + slot64 * stride_ss + i * stride_sn)
                if (rank > 0) & (sc != 0.0):  # the producers' skip, read the same way
                    offs_m = m0 + tl.arange(0, BLOCK_M)
                    m_mask = offs_m < count
                    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
                    # the first block's B and y are in flight while the producers finish
                    w_rank = rank
                    if W_VEC > 1:  # B's columns past the rank are zero padding: whole 16-byte vectors are exact
                        w_rank = ((rank + W_VEC - 1) // W_VEC) * W_VEC
                    w_mask_r = offs_r < w_rank
                    n_loc = c0 + tl.arange(0, BLOCK_N)
                    # B[slot]: [N, R]; y: [T, N] gathered rows
                    w_ptrs = (b_ptr + slot64 * stride_ws + (off_i + n_loc)[:, None] * stride_wn
                              + offs_r[None, :] * stride_wk)
                    y_ptrs = y_ptr + tok[:, None] * stride_ym + (off_i + n_loc)[None, :] * stride_yn
                    n_mask = n_loc < n_end
                    if PREFETCH:
                        w = tl.load(w_ptrs, mask=n_mask[:, None] & w_mask_r[None, :], other=0.0)  # [BN, BR]
                        yt = tl.load(y_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)  # [BM, BN]
                    pair = pid_m * n_slices + i
                    hb = _gather_shrink(x_ptr, a_ptr + slot64 * stride_as, part_ptr, sync_ptr + pair, tok, m_mask,
                                        a_rows, offs_r, rank, T, H, NR, R, i, k_per_split, stride_xm, stride_xk,
                                        stride_an, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, EVEN_K, PRECISION,
                                        SPIN_LIMIT, FALLBACK_K)
                    left = tl.atomic_add(sync_ptr + SYNC_PAIRS + pair, 1, sem="acq_rel", scope="gpu")
                    if left == n_depart - 1:  # the last of this (tile, slice) to leave: counters back to 0
                        tl.atomic_xchg(sync_ptr + pair, 0, sem="relaxed", scope="gpu")
                        tl.atomic_xchg(sync_ptr + SYNC_PAIRS + pair, 0, sem="relaxed", scope="gpu")
                    hb = hb * sc
                    if CAST_BUF:  # 16-bit: round to the weights' dtype for the tensor cores, as PEFT does
                        hb = hb.to(b_ptr.dtype.element_ty)
                    for j in range(0, n_blocks):
                        y_mask = m_mask[:, None] & n_mask[None, :]
                        if not PREFETCH:
                            w = tl.load(w_ptrs, mask=n_mask[:, None] & w_mask_r[None, :], other=0.0)
                            yt = tl.load(y_ptrs, mask=y_mask, other=0.0)
                        if CAST_BUF:
                            acc = tl.dot(hb, tl.trans(w))
                        else:
                            acc = tl.dot(hb, tl.trans(w.to(tl.float32)), input_precision=PRECISION)  # [BM, BN] f32
                        tl.store(y_ptrs, (yt.to(tl.float32) + acc).to(yt.dtype), mask=y_mask)
                        # the next block (prefetch depth 1; a decode chunk is one or two blocks)
                        n_loc += BLOCK_N
                        w_ptrs += BLOCK_N * stride_wn
                        y_ptrs += BLOCK_N * stride_yn
                        n_mask = n_loc < n_end  # past the chunk: masked, nothing read
                        if PREFETCH:
                            w = tl.load(w_ptrs, mask=n_mask[:, None] & w_mask_r[None, :], other=0.0)
                            yt = tl.load(y_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def _gather_shrink(x_ptr, a_ptr, part_ptr, ready_ptr, tok, m_mask, a_rows, offs_r, rank, T, H, NR, R, i, k_per_split,
                   stride_xm, stride_xk, stride_an, stride_ak, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   SPIN_LIMIT: tl.constexpr, FALLBACK_K: tl.constexpr):
    """A consumer's shrink result [BM, BR] float32 (unscaled): the SPLIT_K producers' partials once
    the ready counter says they are all written, summed in split order; or, after SPIN_LIMIT
    polls, the same partials computed here with the producers' code (in K steps of FALLBACK_K:
    this cold path must not raise the kernel's register count) and summed in the same order."""
    ready = tl.load(ready_ptr, volatile=True)
    spins = ready * 0
    while (ready < SPLIT_K) & (spins < SPIN_LIMIT):
        ready = tl.load(ready_ptr, volatile=True)
        spins += 1
    ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")  # the partials' reads come after this
    hb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    part_ptrs = part_ptr + tok[:, None] * NR + (i * R + offs_r)[None, :]  # split 0's [BM, BR] block
    part_mask = m_mask[:, None] & (offs_r < rank)[None, :]
    if ready >= SPLIT_K:
        for s in tl.static_range(SPLIT_K):
            # .cg: from L2, where the producers' partials are (never a stale L1 line)
            hb += tl.load(part_ptrs + s * T * NR, mask=part_mask, other=0.0, cache_modifier=".cg")
    else:  # the producers are not running (no in-order dispatch): do their work, in their order
        for s in range(SPLIT_K):
            s_lo = s * k_per_split
            hb += _shrink_partial(x_ptr, a_ptr, tok, m_mask, a_rows, offs_r < rank, s_lo,
                                  tl.minimum(s_lo + k_per_split, H), stride_xm, stride_xk, stride_an, stride_ak,
                                  BLOCK_M, BLOCK_R, FALLBACK_K, False, PRECISION)
    return hb


_SLICE_TABLES: dict = {}


def _slice_table(slice_sizes: tuple[int, ...], chunk: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(table, pad): [3, pad] int32 flat, slice sizes, column offsets and consumer units; one per
    module shape, chunk width and device, made once per process."""
    key = (slice_sizes, chunk, device)
    hit = _SLICE_TABLES.get(key)
    if hit is None:
        pad = max(2, next_pow2(len(slice_sizes)))
        offs = [0]
        for n in slice_sizes[:-1]:
            offs.append(offs[-1] + n)
        tab = [0] * (3 * pad)
        tab[: len(slice_sizes)] = slice_sizes
        tab[pad : pad + len(slice_sizes)] = offs
        tab[2 * pad : 2 * pad + len(slice_sizes)] = [cdiv(n, chunk) for n in slice_sizes]
        hit = (torch.tensor(tab, dtype=torch.int32, device=device), pad)
        _SLICE_TABLES[key] = hit
    return hit


_SYNC_TABLES: dict = {}


def _sync_table(device: torch.device) -> torch.Tensor:
    """The device's (ready, departed) counters: [2, shapes.SYNC_TABLE_PAIRS] int32, zeroed once here,
    left zero by every launch."""
    table = _SYNC_TABLES.get(device)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "lora_fused: the counter table of this device is made on the first launch, and this first "
                "launch is inside a CUDA graph capture; run the step once before capturing (a warm-up also "
                "compiles the kernels)"
            )
        table = torch.zeros(2 * shapes.SYNC_TABLE_PAIRS, dtype=torch.int32, device=device)
        _SYNC_TABLES[device] = table
    return table


def _scratch(*shape: int, device: torch.device) -> torch.Tensor:
    """Uninitialised float32 scratch (its own function so tests can hand out poisoned memory)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def lora_fused_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor | None,
    slice_sizes: tuple[int, ...],
    meta: LoRABatchMeta,
    config: FusedConfig | None = None,
    spin_limit: int = SPIN_LIMIT,
) -> None:
    """``y += B[slot](A[slot](x)) * scale[slot]`` in one Triton launch; same contract as
    `loramux.kernels.lora_apply`. `config` overrides the launch shape (tests, benchmarks);
    `spin_limit` the polls before a consumer does the shrink itself (0: always, for tests)."""
    slice_sizes = tuple(slice_sizes)
    n_slices, R = check_apply(y, x, lora_a, lora_b, scales, slice_sizes, meta, ranks)
    if isinstance(spin_limit, bool) or not isinstance(spin_limit, int) or spin_limit < 0:
        raise ValueError(f"lora_fused: spin_limit must be an int >= 0, got {spin_limit!r}")
    T, H = x.shape
    if R == 0 or T == 0:
        return
    launch = fused_launch(meta, H, slice_sizes, R, x.dtype, x.device, config)
    if launch.n_tiles == 0:
        return
    if launch.n_tiles * n_slices > shapes.SYNC_TABLE_PAIRS:
        raise ValueError(f"lora_fused: {launch.n_tiles} tiles x {n_slices} slices need more counters than the "
                         f"table's {shapes.SYNC_TABLE_PAIRS}; use the two-kernel path (lora_shrink + lora_expand) for "
                         "batches this large")
    cfg = launch.config
    parts = _scratch(launch.split_k, T, n_slices * R, device=x.device)  # [SPLIT, T, NR], never cleared
    sync = _sync_table(x.device)
    tab, sl_pad = _slice_table(slice_sizes, cfg.block_n * cfg.group, x.device)
    sy, sx, sa, ss, sw = y.stride(), x.stride(), lora_a.stride(), scales.stride(), lora_b.stride()
    vec = 16 // y.element_size()  # 16-byte vectors of y: aligned base, rows and slices
    y_vec = vec if (sy[1] == 1 and sy[0] % vec == 0 and y.data_ptr() % 16 == 0
                    and all(n % vec == 0 for n in slice_sizes)) else 1
    w_vec = 16 // lora_b.element_size()
    w_vec = w_vec if (sw[2] == 1 and R % w_vec == 0) else 1
    S = meta.num_slots
    _fused_kernel[launch.grid](
        y, x, lora_a, lora_b, scales, ranks if ranks is not None else scales, parts, sync, tab,
        meta.sorted_token_ids, meta.active_counts, meta.active_starts, meta.active_slots, meta.num_active,
        T, H, S, n_slices, R, launch.k_per_split, launch.n_units, cfg.group, launch.tile_slots,
        sy[0], sy[1], sx[0], sx[1], sa[0], sa[1], sa[2], ss[0], ss[1], sw[0], sw[1], sw[2],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=max(16, next_pow2(R)), BLOCK_K=cfg.block_k,
        SPLIT_K=launch.split_k, A_PAD=max(32, next_pow2(S)), S_PAD=max(16, next_pow2(S)), SL_PAD=sl_pad,
        SYNC_PAIRS=shapes.SYNC_TABLE_PAIRS, HAS_RANKS=ranks is not None, EVEN_K=H % cfg.block_k == 0,
        CAST_BUF=cfg.cast_buf and y.dtype != torch.float32, PRECISION=dot_precision(x.dtype),
        Y_VEC=y_vec, W_VEC=w_vec, SPIN_LIMIT=spin_limit, FALLBACK_K=min(FALLBACK_BLOCK_K, cfg.block_k),
        PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_regs} if cfg.max_regs and x.device.type == "cuda" else {}),
    )
