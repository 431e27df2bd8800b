"""Bytes resident per adapter tier reach /metrics: the CPU tier's from the registry, the GPU
tier's from the model manager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loramux.engine.layers.layer_slots import LayerSlots
from loramux.registry import LoRAConfig, LoRARequest, Registry
from loramux.engine.core.stats import TierStats, read_tiers
from loramux.registry.cpu_cache import CacheStats
from loramux.serving.metrics import Metrics

pytestmark = pytest.mark.usefixtures("clean_plugin_env")


def render(tiers: dict[str, TierStats]) -> str:
    return Metrics(lambda: tiers, lambda: 0, lambda: 0, lambda: 0).render().decode()


def test_bytes_resident_is_a_gauge_per_tier():
    text = render({"cpu": TierStats(resident=["a", "b"], bytes_resident=4096),
                   "gpu": TierStats(resident=["a"], bytes_resident=None)})
    assert 'loramux_adapter_bytes_resident{tier="cpu"} 4096.0' in text
    assert 'loramux_adapter_bytes_resident{tier="gpu"}' not in text  # the tier does not say
    assert 'loramux_adapters_resident{tier="cpu"} 2.0' in text


def test_the_cpu_tier_reports_the_bytes_the_registry_holds(make_adapter):
    registry = Registry(LoRAConfig(max_loras=2), resolvers=[])
    a = registry.get(LoRARequest("a", 1, str(make_adapter("metric-a"))))
    b = registry.get(LoRARequest("b", 2, str(make_adapter("metric-b", r=4))))
    manager = SimpleNamespace(stats=CacheStats(), resident=lambda: ["a"], nbytes=a.nbytes, capacity_bytes=None,
                              usage=0.5)
    tiers = read_tiers(registry, manager)
    assert tiers["cpu"].bytes_resident == a.nbytes + b.nbytes == registry.cache.nbytes
    assert tiers["cpu"].resident == ["a", "b"] and tiers["gpu"].bytes_resident == a.nbytes


def test_capacity_is_a_gauge_per_tier_the_cpu_budget_and_the_gpu_pools(make_adapter):
    text = render({"cpu": TierStats(bytes_capacity=8 << 30), "gpu": TierStats(bytes_capacity=None)})
    assert 'loramux_adapter_bytes_capacity{tier="cpu"} 8.589934592e+09' in text
    assert 'loramux_adapter_bytes_capacity{tier="gpu"}' not in text  # the tier does not say

    from conftest import tiny_llama

    from loramux.engine.adapters.lora_model import LoRAModelManager

    config = LoRAConfig(max_loras=2, max_cpu_lora_bytes=1 << 20)
    registry = Registry(config, resolvers=[])
    default = LoRAModelManager(tiny_llama(), config)
    rows = sum(LayerSlots.row_bytes(layer.in_features, layer.output_sizes, layer.lora_dtype)
               for layer in default.layers.values())
    assert default.capacity_bytes == rows * 2 * 16  # max_loras x max_lora_rank rows, every layer pooled
    budget = LoRAModelManager(tiny_llama(), LoRAConfig(max_loras=8, max_gpu_lora_bytes=40 * rows + rows // 2))
    assert budget.capacity_bytes == 40 * rows  # whole rows within the budget
    tiers = read_tiers(registry, budget)
    assert tiers["cpu"].bytes_capacity == 1 << 20 and tiers["gpu"].bytes_capacity == 40 * rows


def test_the_cpu_tiers_page_locked_arena_reaches_metrics(make_adapter):
    from loramux.registry.page_locked_arena import PageLockedArena

    arena = PageLockedArena(1 << 20, pinned=False)
    registry = Registry(LoRAConfig(max_loras=1), resolvers=[], host_memory=arena)
    adapter = registry.get(LoRARequest("a", 1, str(make_adapter("metric-arena"))))
    arena.allocate(2 << 20)  # more than the arena: a fallback to pageable memory
    tiers = read_tiers(registry, None)
    cpu = tiers["cpu"]
    assert cpu.pinned_bytes_capacity == 1 << 20 and cpu.pageable_fallbacks == 1
    assert adapter.nbytes <= cpu.pinned_bytes_in_use == arena.stats.in_use_bytes
    text = render(tiers)
    assert 'loramux_adapter_pinned_bytes_capacity{tier="cpu"} 1.048576e+06' in text
    assert 'loramux_adapter_pageable_fallbacks_total{tier="cpu"} 1.0' in text
    assert f'loramux_adapter_pinned_bytes_in_use{{tier="cpu"}} {float(cpu.pinned_bytes_in_use)}' in text
    plain = read_tiers(Registry(LoRAConfig(), resolvers=[], pin_memory=False), None)["cpu"]
    assert plain.pinned_bytes_capacity is None  # pageable memory has no arena to report
