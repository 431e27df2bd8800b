"""Launch shapes of the fused decode kernel (`fused.py`) and the token count up to which
`lora_apply` uses it.

For a static meta (CUDA graphs) every shape comes from T and the module's shape alone, so one
captured graph serves any mix of adapters. The split of K is sized for the one-adapter batch,
the one that needs it most; the tile slots hold twice that batch's tiles, so a many-adapter batch
(up to min(S, T) + T / BLOCK_M tiles of 1-2 tokens) serves a few tiles per program instead of
launching waves of programs that mostly find nothing to do.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .expand import _expand_shape
from .metadata import LoRABatchMeta
from .shrink import MAX_SPLIT_K, _split_for
from .tiles import cdiv, next_pow2, static_block_m, target_programs

__all__ = ["FusedConfig", "FusedLaunch", "fused_config", "static_fused_config", "fused_launch", "fused_fits",
           "fused_max_tokens", "FUSED_MAX_TOKENS_ENV", "SYNC_TABLE_PAIRS"]

#: (tile, slice) counter pairs in a device's table; decode launches need a few hundred.
SYNC_TABLE_PAIRS = 1 << 14
#: lora_apply uses the fused kernel up to this many tokens (env var overrides; 0 turns it off).
DEFAULT_FUSED_MAX_TOKENS = 128
#: Most K splits the heuristic picks: every consumer sums SPLIT_K partials, so more splits make the
#: producers shorter and the consumers longer (down_proj at H=14336 would otherwise get 56).
FUSED_MAX_SPLIT_K = 32
#: SPLIT_K x BLOCK_R at most (rank 16: 32 splits, rank 64: 8): a consumer's partials fit its registers.
FUSED_SPLIT_RANK_BUDGET = 512
FUSED_MAX_TOKENS_ENV = "LORAMUX_FUSED_MAX_TOKENS"


@dataclass(frozen=True)
class FusedConfig:
    """Launch shape: token tile height, expand column block and blocks per consumer, shrink K
    step and split count, tile slots (tiles served side by side; a program serves every
    `tile_slots`-th tile), warps and pipeline stages."""

    block_m: int
    block_n: int
    group: int
    block_k: int
    split_k: int
    tile_slots: int = 1 << 30  # default: every tile its own programs
    num_warps: int = 4
    num_stages: int = 2
    cast_buf: bool = True  # 16-bit y: the shrink result rounded to the weights' dtype (PEFT does)
    #: registers per thread ptxas may use (None: its choice). Both roles and the fallback share one
    #: kernel; left alone ptxas takes ~220-255 at 8B shapes (2 blocks of 4 warps an SM), capped at
    #: 128 it spills a little and 4 blocks fit.
    max_regs: int | None = 128
    #: a consumer issues its first block's loads of y and B before it waits for the producers
    #: (hides a round trip; costs registers: more spills under the cap)
    prefetch: bool = True


@dataclass(frozen=True)
class FusedLaunch:
    config: FusedConfig
    grid: tuple[int]
    n_tiles: int  # tiles of the launch (for a static meta: the bound over every mapping)
    tile_slots: int  # tiles served side by side (<= n_tiles); the grid holds this many
    split_k: int  # splits that cover K (<= config.split_k: empty splits are dropped)
    k_per_split: int
    n_units: int  # consumer column chunks per tile, all slices together


def fused_max_tokens() -> int:
    """Largest T that `lora_apply` sends through the fused kernel (`LORAMUX_FUSED_MAX_TOKENS`,
    default 128; 0 turns the fused kernel off). Read at call time, so a CUDA graph captures the
    path chosen when it was captured."""
    raw = os.environ.get(FUSED_MAX_TOKENS_ENV, "").strip()
    if not raw:
        return DEFAULT_FUSED_MAX_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{FUSED_MAX_TOKENS_ENV}={raw!r} is not understood; use a token count >= 0 "
                         f"(0 turns the fused decode kernel off; default {DEFAULT_FUSED_MAX_TOKENS})")
    return value


def fused_config(meta: LoRABatchMeta, H: int, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                 device: torch.device) -> FusedConfig:
    """Heuristic launch shape, cached on the meta. Both metas get the static shape (from T and the
    module's shape): at decode sizes the one-adapter batch, which needs K split the most, sizes it."""
    key = ("fused", H, slice_sizes, R, dtype, device)
    cfg = meta._cache.get(key)
    if cfg is None:
        cfg = static_fused_config(meta.num_tokens, H, slice_sizes, R, dtype, device)
        meta._cache[key] = cfg
    return cfg


def static_fused_config(num_tokens: int, H: int, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                        device: torch.device) -> FusedConfig:
    """Launch shape from T and the module's shape only: one CUDA graph serves any mapping."""
    return _static_fused_config(num_tokens, H, tuple(slice_sizes), R, dtype, target_programs(device))


@functools.lru_cache(maxsize=1024)
def _static_fused_config(num_tokens: int, H: int, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                         target: int) -> FusedConfig:
    block_m = static_block_m(num_tokens)
    # registers: a producer holds an A tile [BLOCK_R, BLOCK_K] and a consumer loads SPLIT_K partials
    # [BLOCK_M, BLOCK_R] at once; large ranks take shallower K steps and fewer splits
    block_r = max(16, next_pow2(R))
    block_k = (128 if block_r <= 32 else 64) // (2 if dtype == torch.float32 else 1)
    one_adapter_tiles = max(1, cdiv(num_tokens, block_m))
    split_k = min(_split_for(one_adapter_tiles * len(slice_sizes), target, H, block_k), FUSED_MAX_SPLIT_K,
                  max(1, FUSED_SPLIT_RANK_BUDGET // block_r))
    expand = _expand_shape(block_m, one_adapter_tiles, slice_sizes, target)
    # twice the one-adapter tiles side by side: a few-adapter batch runs every tile at once, a
    # many-adapter one (tiles of 1-2 tokens, up to min(S, T) + T / BLOCK_M of them) serves a few
    # tiles per program instead of launching waves of programs that mostly find nothing to do
    tile_slots = max(4, 2 * one_adapter_tiles)
    return FusedConfig(block_m, expand.block_n, expand.group, block_k, split_k, tile_slots)


def fused_launch(meta: LoRABatchMeta, H: int, slice_sizes: tuple[int, ...], R: int, dtype: torch.dtype,
                 device: torch.device, config: FusedConfig | None = None) -> FusedLaunch:
    """The launch `lora_fused_triton` makes. For a static meta it depends on (T, S, H, slice sizes,
    R, dtype, device) only: tests compare it across mappings."""
    cfg = config or fused_config(meta, H, tuple(slice_sizes), R, dtype, device)
    key = ("fused_launch", H, tuple(slice_sizes), R, cfg)
    hit = meta._cache.get(key)
    if hit is None:
        n_tiles = meta.num_tiles(cfg.block_m)
        k_chunks = cdiv(max(H, 1), cfg.block_k)
        k_per_split = cdiv(k_chunks, max(1, min(cfg.split_k, MAX_SPLIT_K))) * cfg.block_k
        split_k = cdiv(max(H, 1), k_per_split)  # drop splits that would be empty
        n_units = sum(cdiv(n, cfg.block_n * cfg.group) for n in slice_sizes)
        tile_slots = max(1, min(cfg.tile_slots, n_tiles))
        grid = (tile_slots * (len(slice_sizes) * split_k + n_units),) if n_tiles else (0,)
        hit = FusedLaunch(cfg, grid, n_tiles, tile_slots, split_k, k_per_split, n_units)
        meta._cache[key] = hit
    return hit


def fused_fits(meta: LoRABatchMeta, n_slices: int, block_m: int = 16) -> bool:
    """Whether a launch's (tile, slice) counters fit the device table (decode sizes always do)."""
    return meta.num_tiles(block_m) * n_slices <= SYNC_TABLE_PAIRS
