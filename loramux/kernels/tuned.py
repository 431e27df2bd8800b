"""Shrink launch shapes tuned on one GPU model, read from a JSON file per device (as vLLM's tuned
LoRA configs are): an eager launch on the whole GPU takes the tuned shape for its module and token
count where one was measured, and the heuristics of `loramux.kernels.shrink` elsewhere.

Why: the heuristics size a launch from the tile count and a program target, and in some cases
they lose to vLLM's tuned shrink by a wide margin; a search per shape on the device finds what a
rule misses (docs/benchmarks/kernels.md compares both sides, each with its tuned shapes).

Files: ``<device name, spaces and dashes as underscores>_shrink.json`` (``NVIDIA_H100_80GB_HBM3_shrink.json``)
in ``loramux/data/kernel_configs``, or in the folder ``LORAMUX_KERNEL_CONFIG_DIR`` names (an empty
folder turns tuning off). ``scripts/tune_shrink.py`` writes them::

    {"device": "NVIDIA H100 80GB HBM3", "entries": [
        {"dtype": "bfloat16", "n_slices": 3, "rank": 16, "hidden": 4096, "tokens": 64,
         "many_adapters": false, "config": {"block_m": 16, "block_n": 16, "block_k": 128,
                                            "split_k": 32, "num_warps": 4, "num_stages": 2}}]}

A launch of T tokens takes the entry of its (dtype, slices, rank, hidden, one or many adapters)
whose token count is nearest T, within a factor of 2, on the same side of `DECODE_MAX_TOKENS`;
none that near: the heuristics. Only eager launches on every multiprocessor read the file: a
CUDA graph's launches (static meta) and those beside a base GEMM keep the heuristics the engine's
step timings were measured with. A prefill-sized launch always takes the one-adapter entry, so
its shape still depends on T alone (`loramux.kernels.tiles.shape_from_tokens_alone`) and the
start-up warm-up compiles it.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from loramux import envs

from .metadata import LoRABatchMeta
from .tiles import DECODE_MAX_TOKENS, shape_from_tokens_alone

__all__ = ["CONFIG_DIR_ENV_VAR", "CONFIG_FIELDS", "KEY_FIELDS", "config_file_name", "config_dir", "many_adapters",
           "tuned_shrink_config"]

CONFIG_DIR_ENV_VAR = envs.env_name("kernel_config_dir")
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "data" / "kernel_configs"
#: The fields of a tuned shrink config (`loramux.kernels.shrink.ShrinkConfig`'s).
CONFIG_FIELDS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
#: What an entry is measured for, besides its token count.
KEY_FIELDS = ("dtype", "n_slices", "rank", "hidden", "many_adapters")


def config_file_name(device_name: str, op: str = "shrink") -> str:
    """The file a device's tuned ``op`` configs live in: ``NVIDIA H100 80GB HBM3`` ->
    ``NVIDIA_H100_80GB_HBM3_shrink.json``."""
    return f"{device_name.replace(' ', '_').replace('-', '_')}_{op}.json"


def config_dir() -> Path:
    """The folder tuned configs are read from: ``LORAMUX_KERNEL_CONFIG_DIR``, else the package's."""
    return envs.current().kernel_config_dir or DEFAULT_DIR


def many_adapters(meta: LoRABatchMeta) -> bool:
    """Whether a launch for ``meta`` takes a many-adapter entry: a decode-sized exact meta with more
    than one adapter active. A prefill-sized one takes the one-adapter entry whatever its mix."""
    return not shape_from_tokens_alone(meta) and meta.num_active > 1


def tuned_shrink_config(device: torch.device, dtype: torch.dtype, n_slices: int, rank: int, hidden: int,
                        num_tokens: int, many_adapters: bool) -> dict[str, int] | None:
    """The tuned shrink config (`CONFIG_FIELDS` -> int) for a launch of ``num_tokens`` tokens on
    a module of ``n_slices`` slices of ``rank`` columns over ``hidden`` inputs, or None where this
    device has no entry near enough (module docstring)."""
    if device.type != "cuda" or num_tokens < 1:
        return None
    index = _device_index(str(config_dir()), torch.cuda.get_device_name(device))
    measured = index.get((str(dtype).removeprefix("torch."), n_slices, rank, hidden, many_adapters))
    if not measured:
        return None
    decode = num_tokens <= DECODE_MAX_TOKENS
    near = [(distance, t, cfg) for t, cfg in measured if (t <= DECODE_MAX_TOKENS) == decode
            for distance in (abs(math.log2(t / num_tokens)),) if distance <= 1]
    return dict(min(near, key=lambda n: n[:2])[2]) if near else None


@functools.lru_cache(maxsize=None)
def _device_index(folder: str, device_name: str) -> dict[tuple, tuple[tuple[int, dict[str, int]], ...]]:
    """A device's entries by key, each key's (tokens, config) pairs; {} when it has no file."""
    path = Path(folder) / config_file_name(device_name)
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())["entries"]
        index: dict[tuple, list] = {}
        for e in entries:
            key = tuple(e[f] for f in KEY_FIELDS)
            config = {f: int(e["config"][f]) for f in CONFIG_FIELDS}
            if min(config.values()) < 1:
                raise ValueError(f"a config field below 1: {config}")
            index.setdefault(key, []).append((int(e["tokens"]), config))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"tuned kernel configs {path} are malformed ({type(e).__name__}: {e}); write them "
                         f"with scripts/tune_shrink.py, or set {CONFIG_DIR_ENV_VAR} to a folder without "
                         f"this file to use the built-in heuristics") from None
    return {key: tuple(sorted(pairs, key=lambda p: p[0])) for key, pairs in index.items()}
