"""What the server reads from the engine besides outputs: the adapter tiers' counters."""

from __future__ import annotations

from typing import Any

from loramux.serving.metrics import RouterStats, TierStats

__all__ = ["engine_requests", "read_tiers", "router_stats", "vocab_size"]


def read_tiers(engine: Any) -> dict[str, TierStats]:
    """Each adapter tier's counters and residents: ``{"cpu": ..., "gpu": ...}``.

    The CPU tier is the registry's ``CPUAdapterCache`` (``.stats``, ``.names()``, ``.nbytes``,
    ``.max_bytes``) and, on CUDA, its page-locked arena (the registry's ``host_memory.stats``);
    the GPU tier is the ``LoRAModelManager`` (``.stats``, ``.resident()``, ``.nbytes``,
    ``.capacity_bytes``). An engine without LoRA has neither.
    """
    tiers: dict[str, TierStats] = {}
    registry = getattr(engine, "registry", None)
    cache = getattr(registry, "cache", None)
    if cache is not None:
        tiers["cpu"] = _tier(cache.stats, cache.names(), getattr(cache, "nbytes", None),
                             getattr(cache, "max_bytes", None))
        arena = getattr(getattr(registry, "host_memory", None), "stats", None)
        if arena is not None:
            tiers["cpu"].pinned_bytes_capacity = arena.capacity_bytes
            tiers["cpu"].pinned_bytes_in_use = arena.in_use_bytes
            tiers["cpu"].pageable_fallbacks = arena.fallbacks
    manager = getattr(engine, "lora_manager", None)
    if manager is not None:
        tiers["gpu"] = _tier(getattr(manager, "stats", None), manager.resident(), getattr(manager, "nbytes", None),
                             getattr(manager, "capacity_bytes", None))
    return tiers


def _tier(stats: Any, resident: list[str], nbytes: int | None, capacity: int | None) -> TierStats:
    counts = {name: getattr(stats, name, None) for name in ("hits", "misses", "loads", "evictions")}
    return TierStats(**counts, resident=list(resident), bytes_resident=nbytes, bytes_capacity=capacity)


def engine_requests(engine: Any) -> int:
    """Requests the engine holds (``get_num_unfinished_requests``), or -1 if it does not say."""
    count = getattr(engine, "get_num_unfinished_requests", None)
    return count() if count is not None else -1


def vocab_size(engine: Any) -> int | None:
    """How many token ids the model embeds (``model.config``), or None if the engine does not say."""
    config = getattr(getattr(engine, "model", None), "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text_config, "vocab_size", None)
    return size if isinstance(size, int) else None


def router_stats(engine: Any) -> RouterStats | None:
    """What an adapter-aware router reads: requests running and waiting, their adapters, the
    adapter slots and the KV cache in use; None for an engine that does not say."""
    demand = getattr(engine, "adapter_demand", None)
    if demand is None:
        return None
    running, waiting = demand()
    setup = getattr(engine, "setup", None)
    usage = getattr(engine, "kv_cache_usage", None)
    prefix = getattr(getattr(engine, "block_manager", None), "stats", None)
    return RouterStats(
        num_running=len(running), num_waiting=len(waiting),
        running_adapters=sorted({name for name in running if name is not None}),
        waiting_adapters=sorted({name for name in waiting if name is not None}),
        max_lora=getattr(getattr(engine, "config", None), "lora_slots", 0),
        kv_cache_usage=usage() if usage is not None else None,
        prefix_cache_queries=getattr(prefix, "queries", None), prefix_cache_hits=getattr(prefix, "hits", None))
