"""Prometheus view of adapter residency, read from the tiers' stats at scrape time.

Names (stable; `loraserve loadtest` scrapes the hit counters):
  loraserve_adapter_hits_total{tier}, loraserve_adapter_misses_total{tier},
  loraserve_adapter_evictions_total{tier}, loraserve_adapter_resident{tier},
  loraserve_adapter_resident_bytes{tier}, loraserve_adapter_capacity_bytes{tier},
  loraserve_adapter_page_in_seconds{source} (histogram), loraserve_parked_requests,
  vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
  (vLLM's gauge, so gateways that route by adapter affinity work unchanged).
"""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class AdapterCollector(Collector):
    def __init__(self, engine):
        self.engine = engine  # LLMEngine with adapters enabled

    def collect(self):
        mgr = self.engine.adapters
        pool, cache, pager = mgr.pool.stats, mgr.cpu_cache.stats, mgr.pager.stats
        tiers = {"gpu": (pool.hits, pool.misses, pool.evictions, pool.resident_adapters,
                         pool.bytes_used, pool.bytes_capacity),
                 "cpu": (pager.cpu_hits, pager.cpu_misses, cache.evictions, cache.entries,
                         cache.bytes, cache.max_bytes)}
        specs = [("hits", CounterMetricFamily, "Adapter lookups served by this tier", 0),
                 ("misses", CounterMetricFamily, "Adapter lookups this tier could not serve", 1),
                 ("evictions", CounterMetricFamily, "Adapters evicted from this tier", 2),
                 ("resident", GaugeMetricFamily, "Adapters resident in this tier", 3),
                 ("resident_bytes", GaugeMetricFamily, "Bytes of resident adapters", 4),
                 ("capacity_bytes", GaugeMetricFamily, "Byte bound of this tier", 5)]
        for name, family, doc, i in specs:
            m = family(f"loraserve_adapter_{name}", doc, labels=["tier"])
            for tier, values in tiers.items():
                m.add_metric([tier], values[i])
            yield m
        reads = CounterMetricFamily("loraserve_adapter_disk_reads", "Catalog blob reads (singleflight)")
        reads.add_metric([], pager.disk_reads)
        yield reads
        yield from mgr.pager.page_in_seconds.collect()
        parked = GaugeMetricFamily("loraserve_parked_requests", "Requests waiting for their adapter to page in")
        parked.add_metric([], len(self.engine.scheduler.parked))
        yield parked
        yield self._lora_requests_info()

    def _lora_requests_info(self) -> GaugeMetricFamily:
        sch = self.engine.scheduler
        running = sorted({s.adapter_key[0] for s in _snapshot(sch.running) if s.adapter_key})
        waiting = sorted({s.adapter_key[0] for s in _snapshot(sch.waiting) + _snapshot(sch.parked.values())
                          if s.adapter_key})
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        g.add_metric([",".join(running), ",".join(waiting), str(self.engine.cfg.max_gpu_adapters)], time.time())
        return g


def _snapshot(items) -> list:
    """A copy of a container the engine thread may be mutating (retry on concurrent change)."""
    for _ in range(5):
        try:
            return list(items)
        except RuntimeError:
            continue
    return []
