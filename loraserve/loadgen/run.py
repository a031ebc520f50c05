"""Running a load test: draw the workload, send it open or closed loop with the configured client
(or wrk), scrape /metrics before and after (and as a timeline for `--report`), and summarize."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import resource
import sys
import time

import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from loraserve.loadgen.client import HTTPClient
from loraserve.loadgen.config import LoadTestConfig
from loraserve.loadgen.sample import Sample, request_httpx, request_raw
from loraserve.loadgen.summary import format_report, summarize, summarize_wrk
from loraserve.loadgen.timeline import MetricsTimeline

HIT_METRIC, MISS_METRIC = "loraserve_adapter_hits_total", "loraserve_adapter_misses_total"
WORDS = ("the", "adapter", "serves", "many", "tenants", "with", "one", "base", "model", "today",
         "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "rests")


class _Workload:
    """Draws (model ref, prompt) pairs reproducibly from the config's seed."""

    def __init__(self, cfg: LoadTestConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        n = len(cfg.adapters)
        weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(n)] if cfg.zipf_s else [1.0] * n
        self.cum = list(np.cumsum(weights)) if n else []
        self.drawn = 0

    def draw(self) -> tuple[str | None, str]:
        if self.cfg.dist == "cycle" and self.cum:
            adapter = self.cfg.adapters[self.drawn % len(self.cfg.adapters)]
        else:
            adapter = self.rng.choices(self.cfg.adapters, cum_weights=self.cum)[0] if self.cum else None
        self.drawn += 1
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(self.cfg.prompt_len))
        return adapter, prompt

    def body(self, adapter: str | None, prompt: str) -> dict:
        cfg = self.cfg
        body = {"model": cfg.base_model, "prompt": prompt, "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "stream": cfg.stream, "ignore_eos": cfg.ignore_eos}
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if adapter is not None:
            body[cfg.model_field] = adapter
        return body


async def _scrape(client: httpx.AsyncClient) -> dict[str, dict[str, float]] | None:
    """`{tier: {"hits": n, "misses": n}}` from the server's /metrics, or None if unavailable."""
    try:
        resp = await client.get("/metrics")
        resp.raise_for_status()
        families = list(text_string_to_metric_families(resp.text))
    except (httpx.HTTPError, ValueError):
        return None
    tiers: dict[str, dict[str, float]] = {}
    for family in families:
        for s in family.samples:
            kind = {HIT_METRIC: "hits", MISS_METRIC: "misses"}.get(s.name)
            if kind is not None:
                counts = tiers.setdefault(s.labels.get("tier", ""), {"hits": 0.0, "misses": 0.0})
                counts[kind] += s.value
    return tiers


async def _base_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    ids = [m["id"] for m in resp.json().get("data", [])]
    bases = [i for i in ids if "/" not in i] or ids
    if not bases:
        raise RuntimeError("the server lists no models; pass --base-model")
    return bases[0]


async def _drive(send, work: _Workload, record) -> None:
    """Send requests until the deadline (or request budget), open or closed loop; await them all.
    `send(adapter, prompt)` makes one request and returns its Sample."""
    cfg = work.cfg
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration
    budget = [cfg.max_requests if cfg.max_requests is not None else float("inf")]

    def take() -> bool:
        if budget[0] <= 0 or time.perf_counter() >= deadline:
            return False
        budget[0] -= 1
        return True

    seen: set[str | None] = set()  # adapters asked for so far: the first request of each is cold

    async def one() -> None:
        start = time.perf_counter() - t0
        adapter, prompt = work.draw()
        cold = adapter not in seen
        seen.add(adapter)
        sample = await send(adapter, prompt)
        sample.start, sample.cold = start, cold
        record(sample)

    if cfg.concurrency is not None:
        async def client_loop() -> None:
            while take():
                await one()
        await asyncio.gather(*(client_loop() for _ in range(cfg.concurrency)))
        return
    tasks, next_at = [], time.perf_counter()
    while True:
        next_at += work.rng.expovariate(cfg.rate)
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if not take():
            break
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)


def _sender(cfg: LoadTestConfig, work: _Workload, headers: dict[str, str]):
    """(send(adapter, prompt) -> Sample, the client to close) for the configured client."""
    if cfg.client == "httpx":
        # idle connections expire well before the server drops them (uvicorn: 5 s by default)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
        client = httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers, timeout=cfg.timeout,
                                   limits=limits)

        async def send_httpx(adapter, prompt):
            return await request_httpx(client, work.body(adapter, prompt))
        return send_httpx, client
    raw = HTTPClient(cfg.url, headers, timeout=cfg.timeout)

    async def send_raw(adapter, prompt):
        return await request_raw(raw, raw.build("POST", "/v1/completions",
                                                 orjson.dumps(work.body(adapter, prompt))), cfg.stream)
    return send_raw, raw


class _CPU:
    """CPU seconds this process (all its threads) and its finished children spent since start."""

    def __init__(self) -> None:
        self.t0 = time.process_time()
        self.c0 = resource.getrusage(resource.RUSAGE_CHILDREN)

    def spent(self) -> float:
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() - self.t0 + (c.ru_utime - self.c0.ru_utime) + (c.ru_stime - self.c0.ru_stime)


async def _run(cfg: LoadTestConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    if cfg.client == "wrk":
        from loraserve.loadgen.wrk import find_wrk
        if find_wrk() is None:
            print("loadtest: wrk is not installed; using the built-in client", file=sys.stderr)
            cfg = dataclasses.replace(cfg, client="raw")
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers, timeout=cfg.timeout) as meta:
        if cfg.base_model is None and (not cfg.adapters or cfg.model_field != "model"):
            cfg = dataclasses.replace(cfg, base_model=await _base_model(meta))
        work = _Workload(cfg)
        before = await _scrape(meta)
        start = time.perf_counter()
        timeline = MetricsTimeline(meta, cfg.scrape_interval, t0=start) if cfg.report_dir else None
        scraper = asyncio.ensure_future(timeline.run()) if timeline is not None else None
        cpu = _CPU()
        try:
            if cfg.client == "wrk":
                result, samples = await _drive_wrk(cfg, work, headers), None
            else:
                result, samples = None, await _drive_client(cfg, work, headers)
            wall = time.perf_counter() - start
            cpu_s = cpu.spent()
        finally:
            if scraper is not None:
                scraper.cancel()
                await asyncio.gather(scraper, return_exceptions=True)
        if timeline is not None:
            await timeline.scrape_once()  # the state at the end
        after = await _scrape(meta)
    if samples is None:
        report = summarize_wrk(cfg, result, wall, before, after)
    else:
        report = summarize(cfg, samples, wall, before, after)
    report["generator_cpu_s"] = cpu_s
    report["generator_cpu_us_per_request"] = 1e6 * cpu_s / report["requests"] if report["requests"] else None
    if cfg.report_dir:
        _write_report(cfg, report, samples, timeline, result)
    return report


async def _drive_client(cfg: LoadTestConfig, work: _Workload, headers: dict[str, str]) -> list[Sample]:
    send, client = _sender(cfg, work, headers)
    samples: list[Sample] = []
    bar = tqdm(total=cfg.max_requests, unit="req", disable=not cfg.progress, desc="loadtest")

    def record(sample: Sample) -> None:
        samples.append(sample)
        bar.update(1)

    try:
        await _drive(send, work, record)
    finally:
        bar.close()
        await client.aclose()
    return samples


async def _drive_wrk(cfg: LoadTestConfig, work: _Workload, headers: dict[str, str]) -> dict:
    from loraserve.loadgen.wrk import run_wrk

    n = len(cfg.adapters) if cfg.dist == "cycle" and cfg.adapters else 4096
    bodies = [orjson.dumps(work.body(*work.draw())) for _ in range(min(n, 200_000))]
    seconds = max(1, round(cfg.duration))
    bar = tqdm(total=seconds, unit="s", disable=not cfg.progress, desc="loadtest (wrk)")

    async def tick() -> None:
        for _ in range(seconds):
            await asyncio.sleep(1.0)
            bar.update(1)

    ticker = asyncio.ensure_future(tick())
    try:
        return await run_wrk(cfg.url, "/v1/completions", bodies, headers, connections=cfg.concurrency,
                             duration=seconds, threads=cfg.wrk_threads, timeout=cfg.timeout)
    finally:
        ticker.cancel()
        bar.close()


def _write_report(cfg: LoadTestConfig, report: dict, samples: list[Sample] | None,
                  timeline: MetricsTimeline, wrk_result: dict | None) -> None:
    from loraserve.loadgen.report import build_series, write_report

    latency = None
    if wrk_result is not None:
        pts = wrk_result["latency_us"]["percentiles"]
        latency = {"e2e_s": {"x": [us / 1e6 for _, us in pts], "p": [p / 100 for p, _ in pts]}}
    series = build_series(report, samples, timeline.rows, bin_s=cfg.scrape_interval, latency=latency)
    page, _ = write_report(cfg.report_dir, report, series, format_report(report))
    report["report_html"] = str(page)


def run_loadtest(cfg: LoadTestConfig) -> dict:
    """Run the load test described by `cfg`; returns the report (see `summarize`)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_run(cfg))
    return uvloop.run(_run(cfg))
