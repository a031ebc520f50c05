"""Soak test: a bounded mixed load against one server for a while, its memory sampled throughout.

    python bench/soak.py --seconds 600                  # starts `loraserve serve` (demo) itself
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --seconds 60
    python bench/soak.py --seconds 60 -- --single-process --max-batch-size 16   # args for serve

`--concurrency` clients (default 8) each send one request after another until `--seconds` have
passed: plain and streamed completions and chats on the base and on adapters (the catalog's first
page), n > 1 over a prompt list, streams the client abandons after the first chunk (aborts),
bad requests (400/404/413 expected) and GET /v1/models, /health, /metrics. Every second the
resident set (VmRSS in /proc/<pid>/status) of the server process and of its children (the engine
core) is sampled. The report: a table of samples, the RSS slope in MiB/min (least squares, over
the whole run and over its second half, after warm-up), and counts per request kind: answered as
expected, answered with another status, transport errors.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("the", "adapter", "serves", "many", "tenants", "with", "one", "base", "model", "today",
         "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "rests")


# -- memory ----------------------------------------------------------------------------------------

def rss_mib(pid: int) -> float | None:
    """VmRSS of `pid` in MiB (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else None


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (scanning /proc/*/stat for parent ids)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


@dataclass(slots=True)
class MemorySample:
    t: float
    server_mib: float
    children_mib: float
    done: int
    unexpected: int

    @property
    def total_mib(self) -> float:
        return self.server_mib + self.children_mib


def slope_mib_per_min(samples: list[MemorySample]) -> float | None:
    """Least-squares slope of total RSS over time, MiB per minute."""
    if len(samples) < 2:
        return None
    ts = [s.t / 60 for s in samples]
    ys = [s.total_mib for s in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else None


# -- load ------------------------------------------------------------------------------------------

@dataclass
class Tally:
    expected: Counter = field(default_factory=Counter)     # kind -> answered as expected
    unexpected: Counter = field(default_factory=Counter)   # (kind, status) -> count
    transport: Counter = field(default_factory=Counter)    # (kind, exception class) -> count

    @property
    def done(self) -> int:
        return (sum(self.expected.values()) + sum(self.unexpected.values())
                + sum(self.transport.values()))

    @property
    def errors(self) -> int:
        return sum(self.unexpected.values()) + sum(self.transport.values())


class Workload:
    """Draws the next request: (kind, method, path, json body, expected status, abandon?)."""

    def __init__(self, base: str, adapters: list[str], max_model_len: int, seed: int):
        self.base, self.adapters, self.max_model_len = base, adapters, max_model_len
        self.rng = random.Random(seed)
        self.kinds = [  # (weight, kind)
            (20, "completion"), (15, "completion-stream"), (15, "chat"), (10, "chat-stream"),
            (8, "n-prompts"), (8, "abandoned-stream"), (6, "bad-value"), (4, "too-long"),
            (4, "unknown-adapter"), (4, "oversized-body"), (3, "models"), (2, "health"),
            (1, "metrics")]

    def _model(self) -> str:
        if self.adapters and self.rng.random() < 0.7:
            return self.rng.choice(self.adapters)
        return self.base

    def _text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def next(self) -> tuple[str, str, str, object, int, bool]:
        kind = self.rng.choices([k for _, k in self.kinds], [w for w, _ in self.kinds])[0]
        tokens = self.rng.randint(1, 24)
        completion = {"model": self._model(), "prompt": self._text(self.rng.randint(2, 24)),
                      "max_tokens": tokens, "temperature": self.rng.choice([0.0, 0.8])}
        chat = {"model": self._model(), "max_tokens": tokens,
                "messages": [{"role": "user", "content": self._text(self.rng.randint(2, 24))}]}
        if kind == "completion":
            return kind, "POST", "/v1/completions", completion, 200, False
        if kind == "completion-stream":
            return kind, "POST", "/v1/completions", {**completion, "stream": True}, 200, False
        if kind == "chat":
            return kind, "POST", "/v1/chat/completions", chat, 200, False
        if kind == "chat-stream":
            body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
            return kind, "POST", "/v1/chat/completions", body, 200, False
        if kind == "n-prompts":
            body = {**completion, "prompt": [self._text(4), self._text(6)], "n": 2}
            return kind, "POST", "/v1/completions", body, 200, False
        if kind == "abandoned-stream":
            body = {**completion, "max_tokens": 48, "stream": True}
            return kind, "POST", "/v1/completions", body, 200, True
        if kind == "bad-value":
            body = self.rng.choice([{**completion, "temperature": -1}, {**completion, "n": 0},
                                    {**chat, "messages": []}, {**completion, "stop": [""]}])
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            return kind, "POST", path, body, 400, False
        if kind == "too-long":
            body = {**completion, "prompt": "x" * (self.max_model_len * 16 + 1)}
            return kind, "POST", "/v1/completions", body, 400, False
        if kind == "unknown-adapter":
            body = {**completion, "model": f"nobody/ghost-{self.rng.randint(0, 10**6)}"}
            return kind, "POST", "/v1/completions", body, 404, False
        if kind == "oversized-body":
            return kind, "POST", "/v1/completions", None, 413, False
        path = {"models": "/v1/models", "health": "/health", "metrics": "/metrics"}[kind]
        return kind, "GET", path, None, 200, False


async def one_request(client: httpx.AsyncClient, work: Workload, tally: Tally,
                      oversized: bytes) -> None:
    kind, method, path, body, expect, abandon = work.next()
    try:
        if kind == "oversized-body":
            r = await client.post(path, content=oversized,
                                  headers={"content-type": "application/json"})
            status = r.status_code
        elif isinstance(body, dict) and body.get("stream"):
            async with client.stream(method, path, json=body) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if abandon and line.startswith("data: "):
                        break  # the client goes away: the server must abort the request
                    if line.startswith('data: {"error"'):
                        status = -1  # an error event inside a 200 stream
        else:
            r = await client.request(method, path, json=body)
            status = r.status_code
    except httpx.HTTPError as exc:
        tally.transport[(kind, type(exc).__name__)] += 1
        return
    if status == expect:
        tally.expected[kind] += 1
    else:
        tally.unexpected[(kind, status)] += 1


async def soak(url: str, pid: int, seconds: float, concurrency: int, seed: int,
               report_every: float, max_request_bytes: int,
               ) -> tuple[list[MemorySample], Tally, float]:
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"]
        base = next(m["id"] for m in models if m.get("parent") is None)
        max_model_len = int(next(m for m in models if m["id"] == base).get("max_model_len", 2048))
        page = await client.get("/v1/models", params={"limit": 50})
        adapters = [m["id"] for m in page.json()["data"] if m["id"] != base]
        oversized = b" " * (max_request_bytes + 1)  # one buffer, sent again and again
        print(f"server {url} pid {pid}: base {base}, {len(adapters)} adapters, "
              f"{concurrency} clients, {seconds:g} s", flush=True)
        tally = Tally()
        start = time.monotonic()
        deadline = start + seconds
        samples: list[MemorySample] = []

        async def client_loop(i: int) -> None:
            work = Workload(base, adapters, max_model_len, seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_request(client, work, tally, oversized)

        async def sampler() -> None:
            next_report = 0.0
            print(f"{'t s':>6} {'server MiB':>11} {'core MiB':>9} {'total MiB':>10} "
                  f"{'requests':>9} {'errors':>7}", flush=True)
            while True:
                t = time.monotonic() - start
                server = rss_mib(pid)
                if server is None:
                    print("the server process is gone", flush=True)
                    return
                kids = sum(filter(None, (rss_mib(c) for c in children(pid))))
                samples.append(MemorySample(t, server, kids, tally.done, tally.errors))
                if t >= next_report or t >= seconds:
                    s = samples[-1]
                    print(f"{t:6.0f} {s.server_mib:11.1f} {s.children_mib:9.1f} "
                          f"{s.total_mib:10.1f} {s.done:9d} {s.unexpected:7d}", flush=True)
                    next_report += report_every
                if t >= seconds:
                    return
                await asyncio.sleep(1.0)

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        await sampling
        return samples, tally, time.monotonic() - start


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    """`loraserve serve` on a free port (uvicorn picks it; read from its log)."""
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--port", "0", *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", line)
        if found:
            url = found.group(1)
            break
    else:
        raise RuntimeError(f"the server did not start (exit code {proc.wait()})")

    def drain() -> None:  # keep reading its log so that the pipe never fills
        for _ in proc.stderr:
            pass

    threading.Thread(target=drain, daemon=True).start()
    return proc, url


def print_report(samples: list[MemorySample], tally: Tally, wall: float) -> None:
    print()
    whole = slope_mib_per_min(samples)
    late = slope_mib_per_min(samples[len(samples) // 2:])
    if samples:
        first, last = samples[0], samples[-1]
        print(f"RSS total: {first.total_mib:.1f} -> {last.total_mib:.1f} MiB "
              f"(min {min(s.total_mib for s in samples):.1f}, "
              f"max {max(s.total_mib for s in samples):.1f})")
    fmt = (lambda v: "n/a" if v is None else f"{v:+.2f} MiB/min")
    print(f"RSS slope (least squares): whole run {fmt(whole)}, second half {fmt(late)}")
    print(f"requests: {tally.done} in {wall:.0f} s ({tally.done / max(wall, 1e-9):.1f}/s), "
          f"as expected {sum(tally.expected.values())}, "
          f"other status {sum(tally.unexpected.values())}, "
          f"transport errors {sum(tally.transport.values())}")
    for kind, count in sorted(tally.expected.items()):
        print(f"  {kind:18s} {count:7d} as expected")
    for (kind, status), count in sorted(tally.unexpected.items()):
        print(f"  {kind:18s} {count:7d} answered {status}")
    for (kind, name), count in sorted(tally.transport.items()):
        print(f"  {kind:18s} {count:7d} {name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server; default: start `loraserve serve` (demo)")
    p.add_argument("--pid", type=int, help="the server's pid, with --url (its RSS is sampled)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="the server's --max-request-bytes (the oversized requests exceed it)")
    p.add_argument("--report-every", type=float, default=None,
                   help="seconds between table rows (default: about 20 rows)")
    args = p.parse_args(argv)
    if (args.url is None) != (args.pid is None):
        p.error("--url and --pid go together")
    report_every = args.report_every or max(1.0, args.seconds / 20)
    proc = None
    if args.url is None:
        proc, url = start_server(serve_args)
        pid = proc.pid
    else:
        url, pid = args.url, args.pid
    try:
        samples, tally, wall = asyncio.run(soak(url, pid, args.seconds, args.concurrency,
                                                args.seed, report_every,
                                                args.max_request_bytes))
        print_report(samples, tally, wall)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
