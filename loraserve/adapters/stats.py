"""Plain counters and gauges of the adapter tiers; the server exports them to Prometheus.

Suggested metric names (the load test scrapes the first two):
`loraserve_adapter_hits_total{tier}`, `loraserve_adapter_misses_total{tier}`,
`loraserve_adapter_evictions_total{tier}`, `loraserve_adapter_resident{tier}`,
`loraserve_adapter_resident_bytes{tier}`, `loraserve_adapter_page_in_seconds{source}` (histogram),
with tier in {"gpu", "cpu"} and source in {"disk", "cpu"}.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Histogram

# Page-in latencies range from microseconds (a CPU-cache hit) to seconds (a big blob off disk).
PAGE_IN_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PAGE_IN_SOURCES = ("cpu", "disk")


def page_in_histogram(buckets: Sequence[float] = PAGE_IN_BUCKETS) -> Histogram:
    """The pager's page-in latency histogram, labelled by `source` ("cpu" | "disk").

    Registered nowhere (many pagers may live in one process); a collector exports it with
    `yield from hist.collect()`. Both sources exist from the start, so both export zeros.
    Raises ValueError for buckets out of order.
    """
    hist = Histogram("loraserve_adapter_page_in_seconds", "Time to page an adapter in, by source tier",
                     ["source"], registry=None, buckets=buckets)
    for source in PAGE_IN_SOURCES:
        hist.labels(source=source)
    return hist


@dataclass(slots=True)
class PoolStats:
    """Device pool ("gpu" tier): counters since start and gauges at snapshot time."""

    max_slots: int
    bytes_capacity: int
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    resident_adapters: int = 0
    pinned_adapters: int = 0
    in_use_adapters: int = 0
    bytes_used: int = 0

    def copy(self) -> "PoolStats":
        return copy.copy(self)


@dataclass(slots=True)
class CacheStats:
    """CPU cache ("cpu" tier): counters since start and gauges at snapshot time."""

    max_bytes: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0  # entries larger than the whole cache, never kept
    bytes: int = 0
    entries: int = 0

    def copy(self) -> "CacheStats":
        return copy.copy(self)


@dataclass(slots=True)
class PagerStats:
    """Pager: where fetched adapters came from; `in_flight` is a gauge at snapshot time.
    (Page-in latency is the pager's own `page_in_seconds` histogram.)"""

    fetches: int = 0
    cpu_hits: int = 0          # served from the CPU cache
    cpu_misses: int = 0        # had to come from disk (a new read or joining one in flight)
    disk_reads: int = 0        # catalog blob reads started (singleflight: one per missing key)
    singleflight_joins: int = 0
    load_errors: int = 0       # disk loads that failed (corrupt, base mismatch, ...)
    blobs_healed: int = 0      # blobs failing their checksum re-fetched from the store (store_heal)
    blobs_carried: int = 0     # blobs that came with their request, read at the edge: no read here
    in_flight: int = 0         # disk loads running or queued right now

    def copy(self) -> "PagerStats":
        return copy.copy(self)
