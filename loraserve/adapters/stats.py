"""Plain counters and gauges of the adapter tiers; the server exports them to Prometheus.

Suggested metric names (the load test scrapes the first two):
`loraserve_adapter_hits_total{tier}`, `loraserve_adapter_misses_total{tier}`,
`loraserve_adapter_evictions_total{tier}`, `loraserve_adapter_resident{tier}`,
`loraserve_adapter_resident_bytes{tier}`, `loraserve_adapter_page_in_seconds{source}` (histogram),
with tier in {"gpu", "cpu"} and source in {"disk", "cpu"}.
"""
from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field

# Page-in latencies range from microseconds (a CPU-cache hit) to seconds (a big blob off disk).
PAGE_IN_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
class Histogram:
    """A Prometheus-style histogram: `counts[i]` observations <= `buckets[i]` (not cumulative),
    the last count for +Inf; `sum` and `count` of all observations."""

    buckets: tuple[float, ...] = PAGE_IN_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError("histogram buckets must be increasing")
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """`(upper bound, cumulative count)` pairs ending with "+Inf", as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass(slots=True)
class PagerStats:
    """Pager: where fetched adapters came from and how long page-in took, by source tier."""

    fetches: int = 0
    cpu_hits: int = 0          # served from the CPU cache
    cpu_misses: int = 0        # had to come from disk (a new read or joining one in flight)
    disk_reads: int = 0        # catalog blob reads started (singleflight: one per missing key)
    singleflight_joins: int = 0
    load_errors: int = 0       # disk loads that failed (corrupt, base mismatch, ...)
    page_in_seconds: dict[str, Histogram] = field(
        default_factory=lambda: {"disk": Histogram(), "cpu": Histogram()})

    def copy(self) -> "PagerStats":
        hist = {k: h.copy() for k, h in self.page_in_seconds.items()}
        return PagerStats(self.fetches, self.cpu_hits, self.cpu_misses, self.disk_reads,
                          self.singleflight_joins, self.load_errors, hist)
