"""`LoRAConfig`: the bounds of the adapter tiers, validated once when it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "CPU_LORA_BYTES_FRACTION",
    "DEFAULT_MAX_PINNED_LORA_BYTES",
    "LORA_DTYPES",
    "LoRAConfig",
    "MAX_LORA_RANK_LIMIT",
    "default_cpu_lora_bytes",
]

MAX_LORA_RANK_LIMIT = 512
# The CPU tier's default byte budget: this share of the host's physical memory.
CPU_LORA_BYTES_FRACTION = 0.10
# ... or this, where the OS does not say how much memory there is.
FALLBACK_CPU_LORA_BYTES = 4 << 30
# The CPU tier's page-locked arena (CUDA), allocated at engine start: at most this much by default.
# Page-locking runs at a few GB/s (the engine logs the time it took), so 8 GiB adds a few seconds
# to a start that compiles and captures graphs for tens of seconds; it holds the CPU tier of the
# many-adapters trace (256 adapters of its mix, ~4 GB) twice over; and the default never locks more
# than the tier's own budget (10% of the host's memory by default).
DEFAULT_MAX_PINNED_LORA_BYTES = 8 << 30
LORA_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}


def default_cpu_lora_bytes() -> int:
    """The CPU tier's default byte budget: 10% of the host's physical memory
    (``os.sysconf``: page size x physical pages), or 4 GiB where the OS does not report it."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX, or the name is unknown here
        return FALLBACK_CPU_LORA_BYTES
    return int(total * CPU_LORA_BYTES_FRACTION) if total > 0 else FALLBACK_CPU_LORA_BYTES


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, low: int, high: int | None = None) -> None:
    allowed = f"an int >= {low}" if high is None else f"an int from {low} to {high}"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise ValueError(f"LoRAConfig.{field}: got {value!r}; allowed: {allowed}")


@dataclass
class LoRAConfig:
    """How many adapters loramux keeps, and how large they may be.

    :param max_loras: an optional cap on the adapters resident on the GPU, and so usable in one
        step (vLLM's name). Default (None): no count binds; the GPU pool's bytes
        (``max_gpu_lora_bytes``) bound what is resident and which adapters share a step.
    :param max_lora_rank: the largest rank an adapter may have (1..512).
    :param max_cpu_loras: adapters kept loaded in host memory; defaults to ``max_loras`` (with no
        cap, None: ``max_cpu_lora_bytes`` alone bounds the tier) and may not be smaller.
    :param lora_dtype: dtype of adapter weights: ``"auto"`` (the model's dtype), ``"float16"``,
        ``"bfloat16"`` or ``"float32"`` (or the matching ``torch.dtype``).
    :param max_cpu_lora_bytes: byte budget of the CPU tier, on top of ``max_cpu_loras``, so a
        fleet of mixed ranks cannot exhaust host memory; default (None) :func:`default_cpu_lora_bytes`,
        10% of the host's memory.
    :param max_gpu_lora_bytes: bytes of GPU memory (per GPU) for the weights of resident
        adapters, taken before the KV cache is sized. Adapters share it by rank (one of rank 8
        takes an eighth of what one of rank 64 takes, and a layer it does not target nothing),
        so many small adapters fit where few large ones do; a new adapter evicts the least
        recently used ones not in use until it fits. Default (None): with ``max_loras`` unset,
        `loramux.engine.layers.weight_pool.default_gpu_lora_bytes` (10% of the GPU, 128 MiB on
        CPU, at most what `MAX_LORA_SLOTS` adapters of ``max_lora_rank`` take); with it set, room
        for ``max_loras`` adapters of ``max_lora_rank`` on every layer, one fixed region each.
    :param max_loading_workers: adapter loads that run at once on the registry's loading
        threads, beside the engine's steps.
    :param max_pinned_lora_bytes: bytes of page-locked host memory the engine reserves at start,
        on CUDA, for the CPU tier (`loramux.registry.page_locked_arena.PageLockedArena`): loads carve their
        buffers from it, so nothing is page-locked while serving; when it is full, a load takes
        pageable memory (slower copies to the GPU). Default (None): ``max_cpu_lora_bytes``, at
        most `DEFAULT_MAX_PINNED_LORA_BYTES` (8 GiB); 0: none, the CPU tier in pageable memory.
        At most ``max_cpu_lora_bytes``.
    """

    max_loras: int | None = None
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str | torch.dtype = "auto"
    max_cpu_lora_bytes: int | None = None
    max_gpu_lora_bytes: int | None = None
    max_pinned_lora_bytes: int | None = None
    max_loading_workers: int = 4

    def __post_init__(self) -> None:
        if self.max_loras is not None:
            _check_int("max_loras", self.max_loras, 1)
        _check_int("max_loading_workers", self.max_loading_workers, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK_LIMIT)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, 1)
        if self.max_loras is not None and self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"LoRAConfig.max_cpu_loras: got {self.max_cpu_loras}; allowed: an int >= "
                f"max_loras ({self.max_loras}), since every GPU slot is backed by the CPU tier"
            )
        if self.max_cpu_lora_bytes is None:
            self.max_cpu_lora_bytes = default_cpu_lora_bytes()
        _check_int("max_cpu_lora_bytes", self.max_cpu_lora_bytes, 1)
        if self.max_gpu_lora_bytes is not None:
            _check_int("max_gpu_lora_bytes", self.max_gpu_lora_bytes, 1)
        if self.max_pinned_lora_bytes is None:
            self.max_pinned_lora_bytes = min(self.max_cpu_lora_bytes, DEFAULT_MAX_PINNED_LORA_BYTES)
        pinned = self.max_pinned_lora_bytes
        if not _is_int(pinned) or not 0 <= pinned <= self.max_cpu_lora_bytes:
            raise ValueError(
                f"LoRAConfig.max_pinned_lora_bytes: got {pinned!r}; allowed: an int from 0 to "
                f"max_cpu_lora_bytes ({self.max_cpu_lora_bytes}), as it holds the CPU tier's weights"
            )
        if isinstance(self.lora_dtype, torch.dtype):
            names = {dtype: name for name, dtype in LORA_DTYPES.items() if dtype is not None}
            if self.lora_dtype not in names:
                raise ValueError(
                    f"LoRAConfig.lora_dtype: got {self.lora_dtype}; allowed: "
                    "torch.float16, torch.bfloat16, torch.float32 or 'auto'"
                )
            self.lora_dtype = names[self.lora_dtype]
        elif self.lora_dtype not in LORA_DTYPES:
            raise ValueError(
                f"LoRAConfig.lora_dtype: got {self.lora_dtype!r}; allowed: {', '.join(LORA_DTYPES)}"
            )

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The adapter dtype as a ``torch.dtype``, or None for "auto" (follow the model)."""
        return LORA_DTYPES[self.lora_dtype]
