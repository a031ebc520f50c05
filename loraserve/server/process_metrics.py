"""Memory of the engine-core process on the API server's /metrics, read at scrape time.

The API server's own memory comes from prometheus_client's ProcessCollector
(`process_resident_memory_bytes`, registered by ServerMetrics). When the engine runs in its own
process (`CoreClient`), its resident memory is `loraserve_engine_core_rss_bytes`, read from
/proc/<core pid>/status (Linux; absent elsewhere, or while no core runs).
"""
from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


def rss_bytes(pid: int) -> int | None:
    """VmRSS of process `pid`, in bytes; None if it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class CoreMemoryCollector(Collector):
    """`loraserve_engine_core_rss_bytes` of `engine.core_pid` (a CoreClient's core process)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        pid = self.engine.core_pid
        rss = rss_bytes(pid) if pid is not None else None
        if rss is not None:
            g = GaugeMetricFamily("loraserve_engine_core_rss_bytes",
                                  "Resident memory of the engine-core process")
            g.add_metric([], rss)
            yield g
