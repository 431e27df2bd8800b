"""What the engine reports about itself besides outputs: each adapter tier's counters and what an
adapter-aware router reads. The server renders them as metrics (`loramux.serving.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.core.block_manager import BlockManager
from loramux.engine.core.sequence import Sequence, SequenceStatus
from loramux.registry import Registry
from loramux.registry.cpu_cache import CacheStats
from loramux.registry.page_locked_arena import PageLockedArena

__all__ = ["RouterStats", "TierStats", "read_router", "read_tiers"]


@dataclass
class TierStats:
    """One adapter tier's counters, as the engine reports them (None: the tier does not count it)."""

    hits: int | None = None
    misses: int | None = None
    loads: int | None = None
    evictions: int | None = None
    resident: list[str] = field(default_factory=list)
    max_adapters: int | None = None  # adapters the tier may hold at once
    bytes_resident: int | None = None  # bytes of the resident adapters' weights
    bytes_capacity: int | None = None  # bytes the tier may hold (its budget)
    usage: float | None = None  # its pressure, 0 to 1 (1: full), as the KV cache's usage
    pinned_bytes_capacity: int | None = None  # its page-locked arena's bytes (CPU tier on CUDA)
    pinned_bytes_in_use: int | None = None  # of those, in pieces not freed yet
    pageable_fallbacks: int | None = None  # loads that found the arena full and took pageable memory


@dataclass
class RouterStats:
    """The engine's load, as vLLM reports it to routers (Gateway API Inference Extension, llm-d)."""

    num_running: int
    num_waiting: int
    running_adapters: list[str]
    waiting_adapters: list[str]
    max_lora: int
    kv_cache_usage: float | None
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int | None = None  # of those, tokens found


def read_router(seqs: list[Sequence], block_manager: BlockManager, *, max_lora: int) -> RouterStats:
    """The router's view of the engine's requests ``seqs``: those running and those waiting (an
    adapter still loading counts as waiting), their adapters, and the KV cache in use."""
    running = [s.lora_name for s in seqs if s.status is SequenceStatus.RUNNING]
    waiting = [s.lora_name for s in seqs if s.status in (SequenceStatus.WAITING, SequenceStatus.LOADING_ADAPTER)]
    prefix = block_manager.stats
    return RouterStats(
        num_running=len(running), num_waiting=len(waiting),
        running_adapters=sorted({name for name in running if name is not None}),
        waiting_adapters=sorted({name for name in waiting if name is not None}),
        max_lora=max_lora, kv_cache_usage=block_manager.usage,
        prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits)


def read_tiers(registry: Registry | None, lora_manager) -> dict[str, TierStats]:
    """Each adapter tier's counters and residents: ``{"cpu": ..., "gpu": ...}``.

    The CPU tier is the registry's ``CPUAdapterCache`` and, on CUDA, its page-locked arena (the
    registry's ``host_memory``); the GPU tier is the ``LoRAModelManager``. An engine without LoRA
    has neither (both None). Each tier's ``usage`` is its pressure: the CPU tier's bytes (or count)
    against its bounds, the GPU tier's fullest layer of pool rows (or its slots).
    """
    tiers: dict[str, TierStats] = {}
    if registry is not None:
        cache = registry.cache
        cpu = tiers["cpu"] = _tier(cache.stats, cache.names(), cache.nbytes, cache.max_bytes)
        cpu.max_adapters = cache.max_loras
        cpu.usage = cache.usage
        if isinstance(registry.host_memory, PageLockedArena):
            arena = registry.host_memory.stats
            cpu.pinned_bytes_capacity = arena.capacity_bytes
            cpu.pinned_bytes_in_use = arena.in_use_bytes
            cpu.pageable_fallbacks = arena.fallbacks
    if lora_manager is not None:
        gpu = tiers["gpu"] = _tier(lora_manager.stats, lora_manager.resident(), lora_manager.nbytes,
                                   lora_manager.capacity_bytes)
        gpu.usage = lora_manager.usage
    return tiers


def _tier(stats: CacheStats, resident: list[str], nbytes: int, capacity: int | None) -> TierStats:
    return TierStats(stats.hits, stats.misses, stats.loads, stats.evictions, resident=list(resident),
                     bytes_resident=nbytes, bytes_capacity=capacity)
