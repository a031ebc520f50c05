"""Prometheus metrics of one server app, in its own CollectorRegistry (no global state)."""
from __future__ import annotations

from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from loraserve.server.vllm_metrics import SequenceMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 10.0, 20.0, 40.0)

# engine.stats() key -> gauge attribute
_STAT_GAUGES = {"running": "running", "waiting": "waiting", "batch_size": "batch_size",
                "kv_usage": "kv_usage", "prefix_cache_hit_rate": "prefix_hit_rate",
                "engine_restarts": "engine_restarts", "engine_ready": "engine_ready"}
# engine.stats() key -> (counter name, documentation): totals the engine keeps, exposed as they are
ENGINE_COUNTERS = {
    "prefix_cache_queries": ("loraserve_prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries)"),
    "prefix_cache_hits": ("loraserve_prefix_cache_hits",
                          "Prompt tokens found in the prefix cache, their K/V not computed again "
                          "(vllm:prefix_cache_hits)")}


class EngineCounters(Collector):
    """The engine's own running totals as Prometheus counters, read at scrape time from the
    stats `ServerMetrics.refresh` saw last (a restarted engine core starts again from 0: a
    counter reset, which `rate()` allows for)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self):
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(self.stats.get(key, 0)))


class ServerMetrics:
    """Request counters, latency histograms and engine gauges of one app.

    Gauges are refreshed from `engine.stats()` at scrape time (`render`). Other owners (the
    adapter pool, say) add their own collectors with `register`.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("loraserve_requests", "HTTP requests on /v1, by status code",
                                ["status"], registry=r)
        self.e2e_latency = Histogram("loraserve_e2e_latency_seconds",
                                     "Request arrival to last token", buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.ttft = Histogram("loraserve_ttft_seconds", "Request arrival to first output",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("loraserve_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("loraserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.running = Gauge("loraserve_running_requests", "Requests running in the engine",
                             registry=r)
        self.waiting = Gauge("loraserve_waiting_requests", "Requests waiting for admission",
                             registry=r)
        self.batch_size = Gauge("loraserve_batch_size", "Sequences in the last engine step",
                                registry=r)
        self.kv_usage = Gauge("loraserve_kv_cache_usage", "Fraction of KV cache blocks in use",
                              registry=r)
        self.engine_restarts = Gauge("loraserve_engine_core_restarts",
                                     "Engine-core processes started again after one died", registry=r)
        self.engine_ready = Gauge("loraserve_engine_ready", "1 while an engine core is up and ready",
                                  registry=r)
        self.prefix_hit_rate = Gauge("loraserve_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / looked up, since start",
                                     registry=r)
        self.sequences = SequenceMetrics(r)  # vLLM's per-sequence histograms (vllm_metrics.py)
        self.engine_counters = EngineCounters()
        r.register(self.engine_counters)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, fds (Linux)

    def register(self, collector: Collector) -> None:
        """Expose another collector (e.g. adapter residency) on this app's /metrics."""
        self.registry.register(collector)

    def delta(self, out) -> None:
        """An engine delta reached the client: its tokens counted; a sequence's last one
        observed in vLLM's per-sequence histograms."""
        self.generation_tokens.inc(len(out.token_ids))
        if out.finish_reason is not None:
            self.sequences.finished(out)

    def count_request(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def refresh(self, stats: dict[str, Any]) -> None:
        """Set the engine gauges from `engine.stats()`; absent keys read 0."""
        for key, attr in _STAT_GAUGES.items():
            value = stats.get(key, 0)
            getattr(self, attr).set(float(value) if isinstance(value, int | float) else 0.0)
        self.engine_counters.stats = stats

    def render(self, stats: dict[str, Any]) -> bytes:
        """The Prometheus text exposition, gauges refreshed from `stats` first."""
        self.refresh(stats)
        return generate_latest(self.registry)
