"""`loraserve loadtest`: drive a running server with many adapters and report latency and hit rates.

Open loop (`--rate R`: Poisson arrivals at R req/s, whatever the server's pace) or closed loop
(`--concurrency C`: C clients, each sending its next request when the last one ends), for
`--duration` seconds. Each request streams `/v1/completions` (TTFT = first streamed text) for an
adapter drawn `uniform`ly or `zipf:S` (the i-th adapter listed has weight 1/i^S) from `--catalog DIR`
(its promoted adapters) or `--adapters FILE` (one model reference per line). The report: ok / errors,
req/s, output tokens/s, TTFT and end-to-end p50/p90/p99, and the server's per-tier adapter hit rates
over the run, from the `loraserve_adapter_{hits,misses}_total{tier=...}` counters on `/metrics`;
also inter-token latency, tokens/s and median latencies over time, cold (the run's first request
for an adapter) against hot requests, and goodput: requests within `--slo-ttft` / `--slo-itl`
(loraserve/loadgen/latency.py). `--max-error-rate R` makes the command fail (exit 1) when more than
R of the requests failed.

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
import json
from pathlib import Path

from loraserve.loadgen.config import CLIENTS, LoadTestConfig
from loraserve.loadgen.run import run_loadtest
from loraserve.loadgen.summary import format_report


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
    p.add_argument("--slo-ttft", type=float, metavar="S",
                   help="goodput: a request counts when its TTFT is at most S seconds")
    p.add_argument("--slo-itl", type=float, metavar="S",
                   help="goodput: ... and its mean inter-token latency at most S seconds")
    p.add_argument("--max-error-rate", type=float, metavar="R",
                   help="exit non-zero when more than this share of requests (0..1) failed")
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
        scrape_interval=args.scrape_interval, wrk_threads=args.wrk_threads, stream=args.stream,
        slo_ttft=args.slo_ttft, slo_itl=args.slo_itl, max_error_rate=args.max_error_rate)
    report = run_loadtest(cfg)
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.report:
        print(f"report: {report['report_html']}")
    if report["ok"] == 0:
        raise RuntimeError(f"no request succeeded ({report['errors']} errors: {report['error_kinds']})")
    check_error_rate(report, cfg.max_error_rate)
    return 0


def check_error_rate(report: dict, max_error_rate: float | None) -> None:
    """RuntimeError (the command exits 1) when the run's error rate passed `max_error_rate`."""
    if max_error_rate is not None and report["error_rate"] > max_error_rate:
        raise RuntimeError(f"error rate {report['error_rate']:.1%} is above --max-error-rate "
                           f"{max_error_rate:.1%} ({report['errors']} of {report['requests']} "
                           f"requests: {report['error_kinds']})")
