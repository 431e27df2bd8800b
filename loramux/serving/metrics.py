"""Prometheus metrics for ``GET /metrics``, with prometheus-client.

Counters the server sees itself (requests, tokens, resolutions, load latency) and the latency
histograms (time to first token, inter-token latency, end-to-end latency, by model: the base
model's name or the adapter's) are updated as requests run; what the adapter tiers count (hits,
misses, loads, evictions, resident adapters, usage) and what a router reads (requests running and
waiting, their adapters, KV-cache usage, under vLLM's names) is read from the engine at scrape
time by collectors, so nothing is counted twice. Each app has its own ``CollectorRegistry``, so
several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loramux.engine.core.stats import RouterStats, TierStats

__all__ = ["CONTENT_TYPE", "Metrics"]

# A model label carries only names the server knows (base, registered or resolved adapters), so a
# client naming random adapters cannot grow the number of series without bound.
UNKNOWN_MODEL = "_unknown"

# vLLM's buckets for the same histograms
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


class _RouterCollector:
    """vLLM's router-facing gauges, read from the engine each time /metrics is scraped.

    ``vllm:lora_requests_info`` is one series whose labels carry the adapters (comma-separated)
    and whose value is the time it was read, as vLLM reports it; a router takes the newest.
    """

    def __init__(self, read: Callable[[], RouterStats | None], model_name: str) -> None:
        self._read = read
        self._model_name = model_name

    def collect(self):
        stats = self._read()
        if stats is None:
            return
        labels, values = ["model_name"], [self._model_name]
        for name, help_, value in (
            ("vllm:num_requests_running", "Requests in the running batch (prefilling or decoding).",
             stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to run (queued, or their adapter loading).",
             stats.num_waiting),
        ):
            family = GaugeMetricFamily(name, help_, labels=labels)
            family.add_metric(values, value)
            yield family
        if stats.kv_cache_usage is not None:
            for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):  # new and old name
                family = GaugeMetricFamily(name, "KV-cache usage, 0 to 1 (1 is full).", labels=labels)
                family.add_metric(values, stats.kv_cache_usage)
                yield family
        if stats.prefix_cache_queries is not None:
            for name, help_, value in (
                ("loramux_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_cache_queries),
                ("loramux_prefix_cache_hits", "Prompt tokens found in the prefix cache (their KV reused).",
                 stats.prefix_cache_hits),
            ):
                family = CounterMetricFamily(name, help_, labels=labels)
                family.add_metric(values, value)
                yield family
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running and waiting LoRA adapters (comma-separated) and max_lora; "
            "the value is the time of the reading.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(stats.running_adapters), ",".join(stats.waiting_adapters),
                         str(stats.max_lora)], time.time())
        yield info


class _TierCollector:
    """Reads the tiers' counters from the engine each time /metrics is scraped."""

    def __init__(self, read_tiers: Callable[[], dict[str, TierStats]]) -> None:
        self._read_tiers = read_tiers

    def collect(self):
        tiers = self._read_tiers()
        families = {
            name: CounterMetricFamily(f"loramux_adapter_cache_{name}", help_, labels=["tier"])
            for name, help_ in (
                ("hits", "Adapter lookups that found the adapter already in the tier."),
                ("misses", "Adapter lookups that had to load the adapter into the tier."),
                ("loads", "Adapters loaded into the tier."),
                ("evictions", "Adapters evicted from the tier to make room (LRU)."),
            )
        }
        resident = GaugeMetricFamily("loramux_adapters_resident", "Adapters held in the tier now.",
                                     labels=["tier"])
        resident_bytes = GaugeMetricFamily("loramux_adapter_bytes_resident",
                                           "Bytes of adapter weights held in the tier now.", labels=["tier"])
        capacity_bytes = GaugeMetricFamily("loramux_adapter_bytes_capacity",
                                           "Bytes of adapter weights the tier may hold.", labels=["tier"])
        usage = GaugeMetricFamily(
            "loramux_adapter_cache_usage_perc",
            "Adapter tier usage, 0 to 1 (1 is full), beside vllm:kv_cache_usage_perc: the CPU tier's bytes "
            "(or adapters, when counted) against its bounds; the GPU pool's fullest layer of rank rows "
            "(or its slots).", labels=["tier"])
        pinned = {
            "pinned_bytes_capacity": GaugeMetricFamily(
                "loramux_adapter_pinned_bytes_capacity",
                "Bytes of the page-locked arena the tier's loads carve buffers from (reserved at start).",
                labels=["tier"]),
            "pinned_bytes_in_use": GaugeMetricFamily(
                "loramux_adapter_pinned_bytes_in_use",
                "Bytes of the page-locked arena in use (adapters, and copies still reading freed ones).",
                labels=["tier"]),
            "pageable_fallbacks": CounterMetricFamily(
                "loramux_adapter_pageable_fallbacks",
                "Loads that found the page-locked arena full and took pageable memory (slower copies "
                "to the GPU; raise max_pinned_lora_bytes).", labels=["tier"]),
        }
        for tier, stats in tiers.items():
            for name, family in families.items():
                if getattr(stats, name) is not None:
                    family.add_metric([tier], getattr(stats, name))
            resident.add_metric([tier], len(stats.resident))
            if stats.bytes_resident is not None:
                resident_bytes.add_metric([tier], stats.bytes_resident)
            if stats.bytes_capacity is not None:
                capacity_bytes.add_metric([tier], stats.bytes_capacity)
            if stats.usage is not None:
                usage.add_metric([tier], stats.usage)
            for name, family in pinned.items():
                if getattr(stats, name) is not None:
                    family.add_metric([tier], getattr(stats, name))
        yield from families.values()
        yield resident
        yield resident_bytes
        yield capacity_bytes
        yield usage
        yield from pinned.values()


class Metrics:
    """The server's metrics; ``render()`` is the /metrics body.

    :param read_tiers: returns each adapter tier's stats (``{"cpu": TierStats, "gpu": ...}``).
    :param queue_depth: requests waiting for the engine (no output yet).
    :param running: requests producing tokens.
    :param engine_requests: requests the engine holds (added, not finished), as it counts them.
    """

    def __init__(
        self,
        read_tiers: Callable[[], dict[str, TierStats]],
        queue_depth: Callable[[], int],
        running: Callable[[], int],
        engine_requests: Callable[[], int],
        read_router: Callable[[], RouterStats | None] = lambda: None,
        model_name: str = "",
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loramux_requests", "HTTP generation requests by model and outcome.",
                                ["model", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("loramux_prompt_tokens", "Prompt tokens processed, by model.",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("loramux_generation_tokens", "Tokens generated, by model.",
                                         ["model"], registry=r)
        self.resolutions = Counter("loramux_adapter_resolutions",
                                   "Adapters named by a request and looked up through the resolvers, "
                                   "by outcome (found, not_found, invalid, error).", ["outcome"], registry=r)
        self.load_seconds = Histogram(
            "loramux_adapter_load_seconds",
            "Time to resolve and load an adapter (resolve, download, read, validate; no queueing "
            "or prefill): on demand for a request (kind=on_demand) or through "
            "/v1/load_lora_adapter (kind=explicit), by the resolver that found it (source).",
            ["kind", "source"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.request_seconds = Histogram("loramux_request_duration_seconds",
                                         "Time from a generation request's arrival to its last token.",
                                         ["endpoint"], registry=r)
        Gauge("loramux_queue_depth", "Engine requests waiting to produce their first token.",
              registry=r).set_function(queue_depth)
        Gauge("loramux_requests_running", "Engine requests producing tokens now.",
              registry=r).set_function(running)
        Gauge("loramux_engine_requests", "Requests the engine holds (a client that left is not among them).",
              registry=r).set_function(engine_requests)
        r.register(_TierCollector(read_tiers))
        r.register(_RouterCollector(read_router, model_name))
        self.time_to_first_token = Histogram(
            "loramux_time_to_first_token_seconds", "Time from a request's arrival to its first token, by model.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "loramux_inter_token_latency_seconds", "Time between two tokens of a request, by model.",
            ["model"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "loramux_e2e_request_latency_seconds", "Time from a request's arrival to its last token, by model.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
