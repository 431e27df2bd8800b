"""Bytes resident per adapter tier reach /metrics: the CPU tier's from the registry, the GPU
tier's from the model manager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loramux.registry import LoRAConfig, LoRARequest, Registry
from loramux.serving.engine_info import read_tiers
from loramux.serving.metrics import Metrics, TierStats

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
    manager = SimpleNamespace(stats=None, resident=lambda: ["a"], nbytes=a.nbytes)
    tiers = read_tiers(SimpleNamespace(registry=registry, lora_manager=manager))
    assert tiers["cpu"].bytes_resident == a.nbytes + b.nbytes == registry.cache.nbytes
    assert tiers["cpu"].resident == ["a", "b"] and tiers["gpu"].bytes_resident == a.nbytes
