"""Memory of the engine-core process on the API server's /metrics, read at scrape time.

The API server's own memory comes from prometheus_client's ProcessCollector
(`process_resident_memory_bytes`, registered by ServerMetrics). When the engine runs in its own
process (`CoreClient`), its resident memory is `loraserve_engine_core_rss_bytes`, read from
/proc/<core pid>/status (Linux; absent elsewhere, or while no core runs).

Both processes' resident memory is also given apart by kind, `loraserve_process_rss_bytes{process,
kind}`: `anonymous` (RssAnon + RssShmem: the process's own memory, what a leak grows) and `file`
(RssFile: mapped files' pages, mostly the catalog's LMDB maps read by its shard hosts and the
model's weights; reclaimable page cache, which grows with every adapter read until the kernel
wants it back). A total alone reads as a leak over a long run of cold adapters.
"""
from __future__ import annotations

import os

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


def rss_kinds(pid: int) -> dict[str, int] | None:
    """{"anonymous": RssAnon + RssShmem, "file": RssFile} of process `pid` in bytes; None if
    they cannot be read."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"RssAnon:", b"RssFile:", b"RssShmem:")):
                    fields[line.split(b":")[0].decode()] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "RssAnon" not in fields or "RssFile" not in fields:
        return None
    return {"anonymous": fields["RssAnon"] + fields.get("RssShmem", 0), "file": fields["RssFile"]}


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
        kinds = GaugeMetricFamily("loraserve_process_rss_bytes", "Resident memory by kind: anonymous "
                                  "(the process's own) and file (mapped files' pages, reclaimable)",
                                  labels=["process", "kind"])
        for process, p in (("api_server", os.getpid()), ("engine_core", pid)):
            for kind, value in ((rss_kinds(p) if p is not None else None) or {}).items():
                kinds.add_metric([process, kind], value)
        yield kinds
