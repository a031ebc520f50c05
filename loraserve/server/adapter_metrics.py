"""Prometheus view of adapter residency, collected at scrape time.

It reads only the engine's published `EngineSnapshot` (tier stats, the page-in histogram,
adapters running and waiting), which is all an API server has when the engine core runs in
another process.

Names (stable; `loraserve loadtest` scrapes the hit counters):
  loraserve_adapter_hits_total{tier}, loraserve_adapter_misses_total{tier},
  loraserve_adapter_evictions_total{tier}, loraserve_adapter_resident{tier},
  loraserve_adapter_resident_bytes{tier}, loraserve_adapter_capacity_bytes{tier},
  loraserve_adapter_disk_reads_total, loraserve_adapter_blobs_carried_total,
  loraserve_adapter_page_in_seconds{source} (histogram),
  loraserve_parked_requests, loraserve_adapter_quarantined, loraserve_catalog_shards_degraded.
vLLM's `vllm:lora_requests_info`, which gateways route by, is router_metrics.py's (every engine).
Behind a facade over several engine replicas (Ray Serve) every series but the catalog's carries
a `replica` label.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.server.router_metrics import labelled_snapshots, label_names

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
        degraded.add_metric([], len(self.engine.catalog.catalog.degraded()))
        yield degraded
        # an engine core that has not published its first snapshot yet has no tier stats
        snaps = [(labels, s) for labels, s in labelled_snapshots(self.engine) if s.pool is not None]
        if not snaps:
            return
        extra = label_names(snaps)
        for i, (name, family, doc) in enumerate(_FAMILIES):
            m = family(f"loraserve_adapter_{name}", doc, labels=[*extra, "tier"])
            for labels, snap in snaps:
                for tier, values in _tiers(snap).items():
                    m.add_metric([*labels.values(), tier], values[i])
            yield m
        reads = CounterMetricFamily("loraserve_adapter_disk_reads", "Catalog blob reads (singleflight)",
                                    labels=extra)
        parked = GaugeMetricFamily("loraserve_parked_requests", "Requests waiting for their adapter to page in",
                                   labels=extra)
        quarantined = GaugeMetricFamily(
            "loraserve_adapter_quarantined", "Adapter revisions quarantined: their numbers went non-finite "
            "in a step, so the engine never serves them again", labels=extra)
        healed = CounterMetricFamily(
            "loraserve_adapter_blobs_healed", "Adapter blobs that failed their checksum here and were "
            "re-fetched from the catalog store, verified and rewritten", labels=extra)
        carried = CounterMetricFamily(
            "loraserve_adapter_blobs_carried", "Adapter blobs read at the edge with their revision "
            "record and carried to the engine with the request: page-ins that read nothing there",
            labels=extra)
        for labels, snap in snaps:
            reads.add_metric(list(labels.values()), snap.pager.disk_reads)
            carried.add_metric(list(labels.values()), snap.pager.blobs_carried)
            healed.add_metric(list(labels.values()), snap.pager.blobs_healed)
            parked.add_metric(list(labels.values()), snap.parked)
            quarantined.add_metric(list(labels.values()), len(snap.quarantined))
        yield reads
        yield carried
        yield healed
        yield _page_in_histogram(snaps)
        yield parked
        yield quarantined


def _tiers(snap) -> dict[str, tuple]:
    """tier -> (hits, misses, evictions, resident, resident bytes, capacity bytes)."""
    pool, cache, pager = snap.pool, snap.cpu_cache, snap.pager
    return {"gpu": (pool.hits, pool.misses, pool.evictions, pool.resident_adapters,
                    pool.bytes_used, pool.bytes_capacity),
            "cpu": (pager.cpu_hits, pager.cpu_misses, cache.evictions, cache.entries,
                    cache.bytes, cache.max_bytes)}


def _page_in_histogram(snaps) -> Metric:
    """The pager's page-in histogram, rebuilt from each snapshot's (name, labels, value) samples."""
    m = Metric("loraserve_adapter_page_in_seconds", "Time to page an adapter in, by source tier",
               "histogram")
    for extra, snap in snaps:
        for name, labels, value in snap.page_in_samples:
            m.add_sample(name, {**extra, **dict(labels)}, value)
    return m
