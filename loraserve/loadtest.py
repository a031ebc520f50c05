"""`loraserve loadtest`: drive a running server with many adapters and report latency and hit rates.

Open loop (`--rate R`: Poisson arrivals at R req/s, whatever the server's pace) or closed loop
(`--concurrency C`: C clients, each sending its next request when the last one ends), for
`--duration` seconds. Each request streams `/v1/completions` (TTFT = first streamed text) for an
adapter drawn `uniform`ly or `zipf:S` (the i-th adapter listed has weight 1/i^S) from `--catalog DIR`
(its promoted adapters) or `--adapters FILE` (one model reference per line). The report: ok / errors,
req/s, output tokens/s, TTFT and end-to-end p50/p90/p99, and the server's per-tier adapter hit rates
over the run, from the `loraserve_adapter_{hits,misses}_total{tier=...}` counters on `/metrics`.

The generator must not be what limits the rate: by default (`--client raw`) it speaks HTTP/1.1
over asyncio itself (loraserve/loadgen/client.py: httptools, orjson, uvloop when installed);
`--client httpx` is the general-purpose client it replaced, kept for comparison; `--client wrk`
drives wrk (closed loop only, no TTFT) and falls back to the built-in client when wrk is not
installed. `--report DIR` also writes DIR/report.html (throughput, latency and TTFT CDFs, tier hit
rates, page-ins, resident adapters and server memory over time, from /metrics scraped every
`--scrape-interval` seconds, errors by kind) and DIR/summary.json (the same numbers).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httptools
import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from loraserve.loadgen.client import HTTPClient
from loraserve.loadgen.timeline import MetricsTimeline

CLIENTS = ("raw", "httpx", "wrk")
HIT_METRIC, MISS_METRIC = "loraserve_adapter_hits_total", "loraserve_adapter_misses_total"
WORDS = ("the", "adapter", "serves", "many", "tenants", "with", "one", "base", "model", "today",
         "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "rests")


@dataclass(slots=True)
class LoadTestConfig:
    """One load test. Exactly one of `rate` (open loop) and `concurrency` (closed loop)."""

    url: str
    adapters: list[str] = field(default_factory=list)  # model refs; empty = base model only
    base_model: str | None = None  # the served base name; None = ask /v1/models when needed
    rate: float | None = None
    concurrency: int | None = None
    dist: str = "uniform"  # "uniform" | "zipf:S" | "cycle" (each adapter in turn: a sweep)
    duration: float = 30.0
    max_requests: int | None = None
    prompt_len: int = 32  # words
    max_tokens: int = 32
    ignore_eos: bool = True
    temperature: float = 0.0
    model_field: str = "model"  # request field that carries the adapter id
    api_key: str | None = None
    timeout: float = 120.0
    seed: int = 0
    progress: bool = True
    client: str = "raw"  # "raw" (built-in HTTP/1.1), "httpx", or "wrk" (closed loop, if installed)
    report_dir: str | None = None  # write report.html and summary.json here
    scrape_interval: float = 1.0  # seconds between /metrics scrapes for the report's timelines
    wrk_threads: int = 1
    stream: bool = True  # False: plain JSON answers (TTFT = end to end; built-in client and wrk)
    zipf_s: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --rate (open loop) and --concurrency (closed loop)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not self.duration > 0 or self.prompt_len < 1 or self.max_tokens < 1 or self.timeout <= 0:
            raise ValueError("--duration, --prompt-len, --max-tokens and --timeout must be positive")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if not self.model_field:
            raise ValueError("--model-field must name a request field")
        if self.client not in CLIENTS:
            raise ValueError(f"--client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if self.client == "wrk" and (self.rate is not None or self.max_requests is not None):
            raise ValueError("--client wrk runs a closed loop for a duration: use --concurrency, not "
                             "--rate or --requests")
        if self.client == "httpx" and not self.stream:
            raise ValueError("--no-stream needs --client raw or wrk")
        if self.report_dir is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--report draws with matplotlib: pip install 'loraserve[report]'")
        if not self.scrape_interval > 0 or self.wrk_threads < 1:
            raise ValueError("--scrape-interval and --wrk-threads must be positive")
        self.zipf_s = _parse_dist(self.dist)


def _parse_dist(dist: str) -> float | None:
    """`uniform` or `cycle` -> None, `zipf:S` -> S (> 0)."""
    if dist in ("uniform", "cycle"):
        return None
    kind, _, s = dist.partition(":")
    try:
        value = float(s)
    except ValueError:
        value = 0.0
    if kind != "zipf" or not value > 0:
        raise ValueError(f"--dist must be 'uniform', 'cycle' or 'zipf:S' with S > 0, got {dist!r}")
    return value


@dataclass(slots=True)
class Sample:
    """The outcome of one request (times in seconds from its start)."""

    ok: bool
    e2e: float
    ttft: float | None = None
    output_tokens: int = 0
    error: str | None = None  # "http 404", "ReadTimeout", ...
    start: float = 0.0  # seconds from the start of the run


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


async def _request(client: httpx.AsyncClient, body: dict) -> Sample:
    """Stream one completion with httpx (`--client httpx`), timing the first text and the end."""
    start = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Sample(False, time.perf_counter() - start, error=f"http {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return Sample(False, time.perf_counter() - start, error="stream error")
                usage = (event.get("usage") or {}).get("completion_tokens", usage)
                if any(c.get("text") for c in event.get("choices", ())):
                    chunks += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Sample(False, time.perf_counter() - start, error=type(e).__name__)
    e2e = time.perf_counter() - start
    return Sample(True, e2e, ttft if ttft is not None else e2e, usage if usage is not None else chunks)


class _Events:
    """The sink of one streamed response (built-in client): SSE events parsed as they arrive."""

    __slots__ = ("start", "buf", "ttft", "chunks", "usage", "error", "stream")

    def __init__(self, start: float, stream: bool = True):
        self.start = start
        self.stream = stream
        self.buf = b""
        self.ttft: float | None = None
        self.chunks = 0
        self.usage: int | None = None
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        if not self.stream:
            self.buf += data
            return
        buf = self.buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self.buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]" or self.error is not None:
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = "JSONDecodeError"
            return
        if "error" in event:
            self.error = "stream error"
            return
        usage = event.get("usage")
        if usage:
            self.usage = usage.get("completion_tokens", self.usage)
        if any(c.get("text") for c in event.get("choices", ())):
            self.chunks += 1
            if self.ttft is None and self.stream:
                self.ttft = time.perf_counter() - self.start

    def finish(self) -> None:
        if not self.stream:  # one JSON answer
            try:
                self._data(self.buf)
            except AttributeError:
                self.error = "unexpected answer"
            return
        if self.buf.strip():
            self.feed(b"\n\n")


async def _request_raw(client: HTTPClient, data: bytes, stream: bool = True) -> Sample:
    """One completion with the built-in client (`data`: the prebuilt request)."""
    start = time.perf_counter()
    events = _Events(start, stream)
    try:
        status = await client.request(data, events.feed)
    except (OSError, httptools.HttpParserError) as e:  # refused, reset, timed out, garbled
        return Sample(False, time.perf_counter() - start, error=type(e).__name__)
    e2e = time.perf_counter() - start
    if status != 200:
        return Sample(False, e2e, error=f"http {status}")
    events.finish()
    if events.error is not None:
        return Sample(False, e2e, error=events.error)
    ttft = events.ttft if events.ttft is not None else e2e
    return Sample(True, e2e, ttft, events.usage if events.usage is not None else events.chunks)


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

    async def one() -> None:
        start = time.perf_counter() - t0
        sample = await send(*work.draw())
        sample.start = start
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
            return await _request(client, work.body(adapter, prompt))
        return send_httpx, client
    raw = HTTPClient(cfg.url, headers, timeout=cfg.timeout)

    async def send_raw(adapter, prompt):
        return await _request_raw(raw, raw.build("POST", "/v1/completions",
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


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values))}


def _hit_rates(before: dict | None, after: dict | None) -> dict[str, float | None] | None:
    """Per tier: hits / (hits + misses) over the run (None when the tier saw no lookups)."""
    if before is None or after is None:
        return None
    rates: dict[str, float | None] = {}
    for tier, counts in after.items():
        prev = before.get(tier, {"hits": 0.0, "misses": 0.0})
        hits, misses = counts["hits"] - prev["hits"], counts["misses"] - prev["misses"]
        rates[tier] = hits / (hits + misses) if hits + misses > 0 else None
    return rates


def summarize(cfg: LoadTestConfig, samples: list[Sample], wall: float,
              before: dict | None = None, after: dict | None = None) -> dict:
    """The report: counts, throughput, latency percentiles (seconds), errors by kind, hit rates."""
    ok = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.error or "error"] = errors.get(s.error or "error", 0) + 1
    tokens = sum(s.output_tokens for s in ok)
    config = asdict(cfg)
    config.pop("api_key")
    config["adapters"] = len(cfg.adapters)
    return {
        "mode": "closed" if cfg.concurrency is not None else "open",
        "config": config,
        "wall_s": wall,
        "requests": len(samples), "ok": len(ok), "errors": len(samples) - len(ok), "error_kinds": errors,
        "req_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": _percentiles([s.ttft for s in ok if s.ttft is not None]),
        "e2e_s": _percentiles([s.e2e for s in ok]),
        "adapter_hit_rate": _hit_rates(before, after),
    }


def summarize_wrk(cfg: LoadTestConfig, result: dict, wall: float,
                  before: dict | None = None, after: dict | None = None) -> dict:
    """The report of a wrk run, in `summarize`'s shape: latencies from wrk's histogram, no TTFT,
    output tokens assumed to be max_tokens per ok request (wrk does not read the events)."""
    statuses = {int(k): v for k, v in result["statuses"].items()}
    ok = sum(n for status, n in statuses.items() if status == 200)
    errors = {f"http {status}": n for status, n in statuses.items() if status != 200}
    errors.update({f"wrk {kind}": n for kind, n in result["errors"].items() if n and kind != "timeout"})
    if result["errors"]["timeout"]:
        errors["ResponseTimeout"] = result["errors"]["timeout"]
    failed = sum(errors.values())
    wall = result["duration_us"] / 1e6 or wall
    pct = dict((p, us / 1e6) for p, us in result["latency_us"]["percentiles"])
    tokens = ok * cfg.max_tokens if cfg.ignore_eos else 0
    config = asdict(cfg)
    config.pop("api_key")
    config["adapters"] = len(cfg.adapters)
    none = {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "mode": "closed", "config": config, "wall_s": wall,
        "requests": ok + failed, "ok": ok, "errors": failed, "error_kinds": errors,
        "req_per_s": ok / wall if wall > 0 else 0.0,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": dict(none),
        "e2e_s": none if ok == 0 else {"p50": pct.get(50.0), "p90": pct.get(90.0), "p99": pct.get(99.0),
                                       "mean": result["latency_us"]["mean"] / 1e6},
        "adapter_hit_rate": _hit_rates(before, after),
    }


def format_report(report: dict) -> str:
    """The report as a small table (latencies in milliseconds)."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    cfg = report["config"]
    load = f"rate {cfg['rate']}/s" if report["mode"] == "open" else f"concurrency {cfg['concurrency']}"
    lines = [f"loadtest {cfg['url']}: {report['mode']} loop, {load}, {cfg['adapters']} adapters "
             f"({cfg['dist']}), {report['wall_s']:.1f} s",
             f"requests  {report['requests']}  ok {report['ok']}  errors {report['errors']}"
             + "".join(f"  [{k}: {n}]" for k, n in sorted(report["error_kinds"].items())),
             f"req/s     {report['req_per_s']:.2f}",
             f"tokens/s  {report['output_tokens_per_s']:.1f}  (output)",
             f"{'ms':<9} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}"]
    for name, key in (("ttft", "ttft_s"), ("e2e", "e2e_s")):
        p = report[key]
        lines.append(f"{name:<9} {ms(p['p50']):>9} {ms(p['p90']):>9} {ms(p['p99']):>9} {ms(p['mean']):>9}")
    cpu = report.get("generator_cpu_us_per_request")
    lines.append(f"client    {cfg.get('client', 'httpx')}"
                 + ("" if cpu is None else f"  (generator CPU {cpu:.0f} us/request)"))
    rates = report["adapter_hit_rate"]
    if rates is None:
        lines.append("adapter hit rate: /metrics unavailable")
    else:
        shown = {t: "-" if r is None else f"{r:.1%}" for t, r in sorted(rates.items())}
        lines.append("adapter hit rate: " + ("  ".join(f"{t} {r}" for t, r in shown.items()) or "no counters"))
    return "\n".join(lines)


def read_adapter_file(path: str | Path) -> list[str]:
    """Model references from a file, one per line; blank lines and `#` comments skipped."""
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line]


def list_catalog_adapters(path: str | Path, limit: int) -> list[str]:
    """Ids of up to `limit` catalog adapters that have a promoted revision (in id order)."""
    from loraserve.catalog.store import Catalog

    with Catalog(path, readonly=True) as catalog:
        return [p.adapter_id for p in catalog.list(limit=limit) if p.promoted is not None]


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register `loraserve loadtest`."""
    p = subparsers.add_parser("loadtest", help="load-test a running server across many adapters",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals at this many req/s")
    loop.add_argument("--concurrency", type=int, help="closed loop: this many clients (default 8)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--catalog", metavar="DIR", help="draw adapters from this catalog's promoted adapters")
    src.add_argument("--adapters", metavar="FILE", help="draw adapters from this file, one id per line")
    p.add_argument("--max-adapters", type=int, default=10000, help="adapters taken from --catalog")
    p.add_argument("--dist", default="uniform", help="adapter popularity: uniform, zipf:S, or cycle (each adapter in turn)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the answers (TTFT = first text); --no-stream: plain JSON answers")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model-field", default="model",
                   help="request field that carries the adapter id (default: model)")
    p.add_argument("--base-model", default=None, help="served base name (default: from /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--report", metavar="DIR", help="write DIR/report.html (charts) and DIR/summary.json")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between /metrics scrapes for --report's timelines")
    p.add_argument("--client", choices=CLIENTS, default="raw",
                   help="raw: built-in HTTP/1.1 client (default); httpx; wrk: drive wrk for raw rate "
                        "(closed loop, no TTFT; falls back to raw when wrk is not installed)")
    p.add_argument("--wrk-threads", type=int, default=1, help="wrk's threads (--client wrk)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.catalog:
        adapters = list_catalog_adapters(args.catalog, args.max_adapters)
    else:
        adapters = read_adapter_file(args.adapters) if args.adapters else []
    if (args.catalog or args.adapters) and not adapters:
        raise ValueError(f"no adapters found in {args.catalog or args.adapters}")
    cfg = LoadTestConfig(
        url=args.url, adapters=adapters, base_model=args.base_model, rate=args.rate,
        concurrency=args.concurrency or (8 if args.rate is None else None), dist=args.dist,
        duration=args.duration, max_requests=args.requests, prompt_len=args.prompt_len,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature,
        model_field=args.model_field, api_key=args.api_key, timeout=args.timeout, seed=args.seed,
        progress=not args.no_progress, client=args.client, report_dir=args.report,
        scrape_interval=args.scrape_interval, wrk_threads=args.wrk_threads, stream=args.stream)
    report = run_loadtest(cfg)
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.report:
        print(f"report: {report['report_html']}")
    if report["ok"] == 0:
        raise RuntimeError(f"no request succeeded ({report['errors']} errors: {report['error_kinds']})")
    return 0

