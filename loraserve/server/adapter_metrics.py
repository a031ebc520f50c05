"""Prometheus view of adapter residency, collected at scrape time.

It reads only the engine's published `EngineSnapshot` (tier stats, the page-in histogram,
adapters running and waiting), which is all an API server has when the engine core runs in
another process.

Names (stable; `loraserve loadtest` scrapes the hit counters):
  loraserve_adapter_hits_total{tier}, loraserve_adapter_misses_total{tier},
  loraserve_adapter_evictions_total{tier}, loraserve_adapter_resident{tier},
  loraserve_adapter_resident_bytes{tier}, loraserve_adapter_capacity_bytes{tier},
  loraserve_adapter_disk_reads_total, loraserve_adapter_page_in_seconds{source} (histogram),
  loraserve_parked_requests, loraserve_catalog_shards_degraded,
  vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
  (vLLM's gauge, so gateways that route by adapter affinity work unchanged).
"""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_FAMILIES = [("hits", CounterMetricFamily, "Adapter lookups served by this tier"),
             ("misses", CounterMetricFamily, "Adapter lookups this tier could not serve"),
             ("evictions", CounterMetricFamily, "Adapters evicted from this tier"),
             ("resident", GaugeMetricFamily, "Adapters resident in this tier"),
             ("resident_bytes", GaugeMetricFamily, "Bytes of resident adapters"),
             ("capacity_bytes", GaugeMetricFamily, "Byte bound of this tier")]


class AdapterCollector(Collector):
    def __init__(self, engine):
        self.engine = engine  # AsyncEngine serving a catalog

    def collect(self):
        degraded = GaugeMetricFamily("loraserve_catalog_shards_degraded",
                                     "Catalog shards unavailable (data files damaged or missing)")
        degraded.add_metric([], len(self.engine.adapter_manager.catalog.degraded()))
        yield degraded
        snap = self.engine.snapshot
        pool, cache, pager = snap.pool, snap.cpu_cache, snap.pager
        if pool is None:  # an engine core that has not published its first snapshot yet
            return
        tiers = {"gpu": (pool.hits, pool.misses, pool.evictions, pool.resident_adapters,
                         pool.bytes_used, pool.bytes_capacity),
                 "cpu": (pager.cpu_hits, pager.cpu_misses, cache.evictions, cache.entries,
                         cache.bytes, cache.max_bytes)}
        for i, (name, family, doc) in enumerate(_FAMILIES):
            m = family(f"loraserve_adapter_{name}", doc, labels=["tier"])
            for tier, values in tiers.items():
                m.add_metric([tier], values[i])
            yield m
        reads = CounterMetricFamily("loraserve_adapter_disk_reads", "Catalog blob reads (singleflight)")
        reads.add_metric([], pager.disk_reads)
        yield reads
        yield _page_in_histogram(snap.page_in_samples)
        parked = GaugeMetricFamily("loraserve_parked_requests", "Requests waiting for their adapter to page in")
        parked.add_metric([], snap.parked)
        yield parked
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(snap.running_adapters), ",".join(snap.waiting_adapters),
                         str(snap.max_lora)], time.time())
        yield info


def _page_in_histogram(samples) -> Metric:
    """The pager's page-in histogram, rebuilt from the snapshot's (name, labels, value) samples."""
    m = Metric("loraserve_adapter_page_in_seconds", "Time to page an adapter in, by source tier",
               "histogram")
    for name, labels, value in samples:
        m.add_sample(name, dict(labels), value)
    return m
