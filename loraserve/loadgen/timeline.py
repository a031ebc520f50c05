"""The server's /metrics over a run: scraped every `interval` seconds into (time, values) rows.

Only the series the report draws are kept (adapter tiers, page-ins, memory, requests by status),
so a scrape costs the generator a few hundred microseconds; the text is parsed with
prometheus_client's parser. A series is keyed `name{label="value",...}` (labels sorted).
"""
from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# names (prefixes) of the series a timeline keeps
KEPT = ("loraserve_adapter_hits_total", "loraserve_adapter_misses_total",
        "loraserve_adapter_resident", "loraserve_adapter_page_in_seconds_count",
        "loraserve_adapter_evictions_total", "loraserve_parked_requests",
        "loraserve_requests_total", "process_resident_memory_bytes",
        "loraserve_engine_core_rss_bytes", "loraserve_process_rss_bytes")


def series_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse_kept(text: str) -> dict[str, float]:
    """The kept samples of a Prometheus text exposition, by series key."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(KEPT)) + "\n"
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(lines):
        for s in family.samples:
            if s.name.startswith(KEPT) and not s.name.endswith("_created"):
                out[series_key(s.name, s.labels)] = s.value
    return out


class MetricsTimeline:
    """Scrape `client`'s /metrics every `interval` seconds while `run()` runs (cancel to stop).

    `rows` holds (seconds since `t0`, {series key: value}); a failed scrape is skipped and
    counted in `failures`.
    """

    def __init__(self, client: httpx.AsyncClient, interval: float = 1.0, t0: float | None = None):
        self.client = client
        self.interval = interval
        self.t0 = time.perf_counter() if t0 is None else t0
        self.rows: list[tuple[float, dict[str, float]]] = []
        self.failures = 0

    async def scrape_once(self) -> None:
        try:
            resp = await self.client.get("/metrics")
            resp.raise_for_status()
            values = parse_kept(resp.text)
        except (httpx.HTTPError, ValueError):
            self.failures += 1
            return
        self.rows.append((time.perf_counter() - self.t0, values))

    async def run(self) -> None:
        next_at = time.perf_counter()
        while True:
            await self.scrape_once()
            next_at += self.interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
