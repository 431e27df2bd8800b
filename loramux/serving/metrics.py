"""Prometheus metrics for ``GET /metrics``, with prometheus-client.

Counters the server sees itself (requests, tokens, resolutions, load latency) are updated as
requests run; what the adapter tiers count (hits, misses, loads, evictions, resident adapters)
is read from the engine at scrape time by a collector, so nothing is counted twice. Each app has
its own ``CollectorRegistry``, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics", "TierStats"]

# A model label carries only names the server knows (base, registered or resolved adapters), so a
# client naming random adapters cannot grow the number of series without bound.
UNKNOWN_MODEL = "_unknown"


@dataclass
class TierStats:
    """One adapter tier's counters, as the engine reports them (None: the tier does not count it)."""

    hits: int | None = None
    misses: int | None = None
    loads: int | None = None
    evictions: int | None = None
    resident: list[str] = field(default_factory=list)
    bytes_resident: int | None = None  # bytes of the resident adapters' weights


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
        for tier, stats in tiers.items():
            for name, family in families.items():
                if getattr(stats, name) is not None:
                    family.add_metric([tier], getattr(stats, name))
            resident.add_metric([tier], len(stats.resident))
            if stats.bytes_resident is not None:
                resident_bytes.add_metric([tier], stats.bytes_resident)
        yield from families.values()
        yield resident
        yield resident_bytes


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
            "Time from asking for an adapter that was not loaded to its first use (resolve, "
            "download, load, validate), or to load one through /v1/load_lora_adapter.",
            ["kind"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
