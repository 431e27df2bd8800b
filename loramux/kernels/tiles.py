"""Shared Triton helpers and launch heuristics for the segmented (SGMV) kernels.

A launch's work items are tile-major: item ``w`` serves live tile ``w // per_tile``, the live
tiles numbered slot after slot over the segments whose slot has a rank on the module
(`live_segments`, `tile_at`). The grid's programs loop over the items with its stride, so a grid
sized from a bound (a static meta) runs a bounded number of programs (`looped_grid`), not one
per item of the bound.

Also here: whether a launch may use programmatic dependent launch (`pdl_available`,
`resolve_pdl`; ``LORAMUX_PDL``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from loramux import envs

from .pool import POOL_ROW_ALIGN

if TYPE_CHECKING:  # metadata builds on these tiles (through static_meta)
    from .metadata import LoRABatchMeta


@triton.jit
def live_segments(counts_ptr, starts_ptr, slots_ptr, ranks_ptr, num_active,
                  BLOCK_M: tl.constexpr, A_PAD: tl.constexpr, HAS_RANKS: tl.constexpr):
    """The batch's segments with work for this module, as [A_PAD] vectors, one lane per active
    slot: (token counts, segment starts, slots, ranks, tiles per segment, inclusive prefix sum of
    the tiles). The live tiles are numbered slot after slot; their count is the sum of the tiles.

    The three slot vectors load side by side (one round trip), the slots' ranks after them: a
    segment whose slot has rank 0 here (its adapter does not touch this module) counts no tiles,
    so no program spends time on it. Loads are masked by num_active: the vectors need no padding
    past num_active entries, and a static meta's lanes of unused slots hold no tokens.
    """
    a_idx = tl.arange(0, A_PAD)
    real = a_idx < num_active
    cnt = tl.load(counts_ptr + a_idx, mask=real, other=0)  # [A_PAD]
    sts = tl.load(starts_ptr + a_idx, mask=real, other=0)
    sls = tl.load(slots_ptr + a_idx, mask=real, other=0)
    if HAS_RANKS:
        rks = tl.load(ranks_ptr + sls, mask=real & (cnt > 0), other=0).to(tl.int32)
        cnt = tl.where(rks > 0, cnt, 0)
    else:
        rks = tl.zeros([A_PAD], dtype=tl.int32)
    ntile = (cnt + BLOCK_M - 1) // BLOCK_M
    return cnt, sts, sls, rks, ntile, tl.cumsum(ntile, 0)


@triton.jit
def tile_at(t, cnt, sts, sls, rks, ntile, cum, BLOCK_M: tl.constexpr, A_PAD: tl.constexpr):
    """Live tile ``t`` (below the sum of `live_segments`' tiles) -> (slot, its rank, segment
    start, segment length, the tile's first row in the segment): register work, no load."""
    sel = tl.arange(0, A_PAD) == tl.sum((cum <= t).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(sel, cum - ntile, 0), 0)
    count = tl.sum(tl.where(sel, cnt, 0), 0)
    slot = tl.sum(tl.where(sel, sls, 0), 0)
    rank = tl.sum(tl.where(sel, rks, 0), 0)
    start = tl.sum(tl.where(sel, sts, 0), 0)
    return slot, rank, start, count, (t - first_tile) * BLOCK_M


def slot_lanes(meta: LoRABatchMeta) -> int:
    """`live_segments`' A_PAD: lanes enough for every active slot of the batch, of which there are
    at most min(S, T), or a static meta's bound (its ``num_active``). Sized from S alone, a decode
    step of 64 tokens with 256 slots loaded and scanned 256-lane vectors in every program."""
    return max(32, next_pow2(meta.num_active if meta.static else min(meta.num_slots, meta.num_tokens)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a JIT wrapper: slow on the host, called per launch


POOL_ALIGN = tl.constexpr(POOL_ROW_ALIGN)  # `loramux.kernels.pool`'s, readable inside kernels


@triton.jit
def pool_width(rank):
    """The rows a slot of this rank owns in a pool (the kernels' `pool_rows`)."""
    return ((rank + POOL_ALIGN - 1) // POOL_ALIGN) * POOL_ALIGN


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return envs.current().triton_interpret


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device, sms: int | None = None) -> int:
    """Programs that keep the multiprocessors a launch may use busy (two per SM): every SM of the
    device, or ``sms`` of them (a launch beside a GEMM that leaves it that many,
    `loramux.engine.layers.side_stream`); tiny under the interpreter."""
    if device.type != "cuda" or interpreting():
        return 4
    if sms:
        return 2 * sms
    return 2 * num_sms(device.index if device.index is not None else torch.cuda.current_device())


DECODE_MAX_TOKENS = 256  # a batch of at most this many tokens is decode-sized: latency bound

#: A decode graph's shrink and expand are sized so that the one-adapter batch's grid fills this
#: share of `target_programs` (one program per multiprocessor of the launch's share, not two). A
#: batch of many adapters fills the same grid with a tile per adapter; sized for the full target,
#: its every tile ran as many short programs as the one adapter's, and the delta outlasted the
#: GEMM beside it. Half the target shortens the many-adapter kernels and leaves the one-adapter
#: ones as they were, which the decode step shows (docs/benchmarks/throughput.md).
STATIC_DECODE_FILL = 0.5


#: A launch runs at most this many times `target_programs` programs, or the one-adapter batch's
#: item count where that is more, each program looping over the live work items with the grid's
#: stride. A static meta's bound over every mapping has an item per tile of the worst case: a
#: program per item, most finding no work (tiles past the batch's, slots of rank 0 here), ran in
#: waves behind the real ones. Far fewer programs, each looping over many items, run a
#: many-adapter batch's items one after the other, each waiting on its own loads: slower again.
LOOP_FILL = 8


def looped_grid(meta: LoRABatchMeta, block_m: int, per_tile: int, target: int) -> tuple[int]:
    """The grid of a launch over ``meta``'s tiles of ``block_m`` rows, ``per_tile`` work items
    each, sized for ``target`` programs (`LOOP_FILL`); empty for a batch with no tile."""
    one_adapter_work = cdiv(meta.num_tokens, block_m) * per_tile
    return (min(meta.num_tiles(block_m) * per_tile, max(one_adapter_work, LOOP_FILL * target)),)


def shape_from_tokens_alone(meta: LoRABatchMeta) -> bool:
    """Whether ``meta``'s launch shapes come from T and the module's shape alone, not from its
    adapter segments: a static meta (a CUDA graph serves any mix) and any prefill-sized batch.

    Prefill-sized steps run eagerly in the engine (past its largest step graph), and every launch
    shape is a Triton compile of seconds: shaped from their segments, a step with a mix of adapters
    not seen before would compile kernels mid-serving, one step lasting seconds. From T alone, a mix changes a launch's grid, never its kernel, and the
    start-up warm-up's one-adapter steps compile every kernel serving will use."""
    return meta.static or meta.num_tokens > DECODE_MAX_TOKENS


def static_block_m(num_tokens: int) -> int:
    """Tile height from T alone (the one-adapter case has segments of T tokens, the many-adapter
    case segments of a few; 16-row tiles serve both at decode, 64-row ones fit long prompts)."""
    if num_tokens <= 128:
        return 16
    if num_tokens <= 512:
        return 32
    return 64


def block_m_for(meta: LoRABatchMeta) -> int:
    """Tile height from the longest segment: decode segments are short, prefill ones long."""
    m = meta.max_segment
    if m <= 16:
        return 16
    if m <= 32:
        return 32
    return 64


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: full-precision products (tf32 would land near 3e-4); 16-bit: ignored
    return "ieee" if dtype == torch.float32 else "tf32"


# --- programmatic dependent launch (PDL) ------------------------------------------------------
PDL_ENV_VAR = envs.env_name("pdl")


def pdl_available(device: torch.device | str) -> bool:
    """Whether a kernel on ``device`` can be launched with programmatic dependent launch: a CUDA
    device of compute capability 9.0 or more (Hopper on), the Triton interpreter off, and a Triton
    that has both ``tl.extra.cuda.gdc_wait`` and the ``launch_pdl`` launch option. Cached per
    device."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return False
    return _pdl_on_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_on_device(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_has_pdl()


def _triton_has_pdl() -> bool:
    if not hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_default() -> bool:
    """The PDL setting a launch takes when its caller names none: ``LORAMUX_PDL=1`` turns it on;
    unset (or 0), off."""
    return envs.current().pdl


def resolve_pdl(pdl: bool | None, device: torch.device) -> bool:
    """Whether a launch on ``device`` uses PDL: what the caller asked (None: `pdl_default`), and
    never where it is not available (`pdl_available`): there a request is dropped silently."""
    if pdl is None:
        pdl = pdl_default()
    return bool(pdl) and pdl_available(device)
