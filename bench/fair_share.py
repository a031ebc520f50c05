"""Fair share between tenants, end to end: one tenant's short requests under another's long prompts.

    python bench/fair_share.py [--model DIR] [--a-requests 40] [--b-concurrency 32] [--b-prompt 500]
                               [--serve-arg=--max-batched-tokens=512] [--scheduler OLD.py]

Starts `loraserve serve` on the base alone with a keys file of two tenants, A and B (issue 22,
row 7). Tenant A sends `--a-requests` short requests one after the other (8-token prompt,
`--a-max-tokens` tokens, greedy), first alone, then while tenant B keeps `--b-concurrency`
requests with `--b-prompt`-token prompts (16 tokens each) in flight, each sent again as soon as
it is answered. Prints A's latency (p50, p95, max) in both phases and B's requests and prompt
tokens per second under the second.

`--scheduler FILE` serves with another `loraserve/engine/core/scheduler.py` (e.g. an older one, for
an A/B: `git show REV:loraserve/engine/core/scheduler.py > old.py`): its `Scheduler` class replaces
the current one in the server and the engine core (a sitecustomize on their PYTHONPATH).

`--simulate` runs the same two closed loops against the scheduler alone, with no model and no
server: a step costs `--step-ms` plus `--prefill-ms` per prompt token (prefill) or `--decode-ms`
per sequence (decode) (defaults: the demo base on one core of the 2-core machine), a client
sends its next request `--rtt-ms` after an answer. Deterministic: on a busy machine the HTTP
run's latencies move with everything else running, this does not.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import asyncio
import hashlib
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time

import httpx

SITECUSTOMIZE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_bench_scheduler", {path!r})
module = importlib.util.module_from_spec(spec)
import loraserve.engine.core.scheduler as current
module.__package__ = "loraserve.engine"
spec.loader.exec_module(module)
current.Scheduler = module.Scheduler
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys_file(directory: Path) -> Path:
    def entry(tenant: str) -> str:
        sha = hashlib.sha256(f"k-{tenant}".encode()).hexdigest()
        return f'[keys.{tenant}]\nsha256 = "{sha}"\nrole = "user"\ntenants = ["{tenant}"]\n'

    path = directory / "keys.toml"
    path.write_text(entry("A") + entry("B"))
    return path


def serve(model: str, directory: Path, port: int, extra: list[str],
          scheduler: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    if scheduler is not None:
        hook = directory / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=str(Path(scheduler).resolve())))
        env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", model, "--port", str(port),
           "--keys", str(keys_file(directory)), "--max-model-len", "1024", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"loraserve serve exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("loraserve serve did not become ready")


def a_latencies(url: str, model: str, requests: int, max_tokens: int) -> list[float]:
    body = {"model": model, "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    out = []
    with httpx.Client(base_url=url, timeout=600, headers={"Authorization": "Bearer k-A"}) as http:
        for _ in range(3):  # warm-up
            http.post("/v1/completions", json=body).raise_for_status()
        for _ in range(requests):
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json=body)
            out.append(time.perf_counter() - t0)
            r.raise_for_status()
    return out


class Load:
    """Tenant B: `concurrency` requests with `prompt`-token prompts always in flight."""

    def __init__(self, url: str, model: str, concurrency: int, prompt: int):
        self.url, self.model, self.concurrency, self.prompt = url, model, concurrency, prompt
        self.done = 0
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=600,
                                     headers={"Authorization": "Bearer k-B"},
                                     limits=httpx.Limits(max_connections=self.concurrency + 4)) as http:
            async def worker(i: int) -> None:
                n = 0
                while not self.stop.is_set():
                    n += 1
                    prompt = [3 + (7 * i + 13 * n + k) % 240 for k in range(self.prompt)]
                    r = await http.post("/v1/completions", json={
                        "model": self.model, "prompt": prompt, "max_tokens": 16,
                        "temperature": 0, "ignore_eos": True})
                    r.raise_for_status()
                    self.done += 1
                    self.started.set()

            await asyncio.gather(*(worker(i) for i in range(self.concurrency)))

    def __enter__(self) -> Load:
        self.thread.start()
        self.started.wait(600)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(600)


def simulate(scheduler_cls, args: argparse.Namespace, budget: int, with_b: bool) -> tuple[list[float], float]:
    """A's latencies (s) and B's requests per second, in simulated time (module doc)."""
    import heapq
    import itertools

    from loraserve.engine.core.block_manager import BlockManager
    from loraserve.engine.core.sequence import Sequence
    from loraserve.engine.types import SamplingParams

    sch = scheduler_cls(BlockManager(1 << 20, 16), max_batch_size=64, max_batched_tokens=budget)
    ids, events, now = itertools.count(), [], 0.0
    a_params = SamplingParams(max_tokens=args.a_max_tokens, temperature=0.0, ignore_eos=True)
    b_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def new(kind: str) -> Sequence:
        n = next(ids)
        base = 10**7 * (n + 1)
        length, params = (8, a_params) if kind == "A" else (args.b_prompt, b_params)
        return Sequence(f"{kind}{n}", [base + i for i in range(length)], params, tenant=kind)

    for i in range(args.b_concurrency if with_b else 0):
        heapq.heappush(events, (i * 1e-3, next(ids), "B"))
    heapq.heappush(events, (0.5, next(ids), "A"))
    sent, lat, b_done, t0 = {}, [], 0, None
    while len(lat) < args.a_requests:
        while events and events[0][0] <= now:
            at, _, kind = heapq.heappop(events)
            seq = new(kind)
            sent[seq.request_id] = at
            sch.add(seq)
        batch, is_prefill = sch.schedule()
        if not batch:
            now = events[0][0]
            continue
        ms = args.step_ms + (args.prefill_ms * sum(s.num_scheduled for s in batch) if is_prefill
                             else args.decode_ms * len(batch))
        now += ms / 1e3
        for seq in batch:
            seq.num_cached = seq.num_cached + seq.num_scheduled if is_prefill else len(seq)
        for seq in batch:
            if seq.num_pending == 0:
                seq.output_ids.append(7)
                if len(seq.output_ids) >= seq.params.max_tokens:
                    sch.remove(seq)
                    if seq.tenant == "A":
                        t0 = now if t0 is None else t0
                        lat.append(now - sent[seq.request_id])
                    elif t0 is not None:
                        b_done += 1
                    heapq.heappush(events, (now + args.rtt_ms / 1e3, next(ids), seq.tenant))
    return lat, b_done / (now - t0)


def load_scheduler(path: str | None):
    import loraserve.engine.core.scheduler as current
    if path is None:
        return current.Scheduler
    import importlib.util
    spec = importlib.util.spec_from_file_location("loraserve.engine._bench_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "loraserve.engine"
    spec.loader.exec_module(module)
    return module.Scheduler


def summary(lat: list[float]) -> str:
    lat = sorted(lat)
    p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
    return f"{statistics.median(lat) * 1e3:8.1f} {p95 * 1e3:8.1f} {lat[-1] * 1e3:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--a-requests", type=int, default=40)
    ap.add_argument("--a-max-tokens", type=int, default=8)
    ap.add_argument("--b-concurrency", type=int, default=32)
    ap.add_argument("--b-prompt", type=int, default=500)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra `loraserve serve` argument (repeatable), e.g. --serve-arg=--max-batched-tokens=512")
    ap.add_argument("--scheduler", default=None, help="serve with this scheduler.py instead")
    ap.add_argument("--simulate", action="store_true", help="the scheduler alone, step costs modelled")
    ap.add_argument("--budget", type=int, action="append", help="--simulate: max_batched_tokens "
                    "(repeatable; default 4096, 2048, 512)")
    ap.add_argument("--step-ms", type=float, default=3.0)
    ap.add_argument("--prefill-ms", type=float, default=0.07)
    ap.add_argument("--decode-ms", type=float, default=0.3)
    ap.add_argument("--rtt-ms", type=float, default=5.0)
    args = ap.parse_args()
    if args.simulate:
        cls = load_scheduler(args.scheduler)
        print(f"simulated: A {args.a_requests} requests, 8-token prompt, {args.a_max_tokens} tokens; "
              f"B {args.b_concurrency} in flight, {args.b_prompt}-token prompts, 16 tokens; step "
              f"{args.step_ms} ms + {args.prefill_ms} ms/prompt token | {args.decode_ms} ms/sequence; "
              f"rtt {args.rtt_ms} ms; scheduler {args.scheduler or 'current'}")
        print(f"{'budget':>7} {'A alone p50':>12} {'A under B p50':>14} {'p95':>8} {'B req/s':>8}")
        for budget in args.budget or [4096, 2048, 512]:
            alone, _ = simulate(cls, args, budget, False)
            loaded, b_rate = simulate(cls, args, budget, True)
            lat = sorted(loaded)
            print(f"{budget:>7} {statistics.median(alone) * 1e3:>12.1f} "
                  f"{statistics.median(lat) * 1e3:>14.1f} {lat[int(0.95 * len(lat))] * 1e3:>8.1f} "
                  f"{b_rate:>8.1f}")
        return
    model = base_or_demo(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = serve(model, Path(tmp), port, args.serve_arg, args.scheduler)
        try:
            name = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k-A"}).json()["data"][0]["id"]
            alone = a_latencies(url, name, args.a_requests, args.a_max_tokens)
            with Load(url, name, args.b_concurrency, args.b_prompt) as load:
                t0, done0 = time.perf_counter(), load.done
                loaded = a_latencies(url, name, args.a_requests, args.a_max_tokens)
                seconds, b_done = time.perf_counter() - t0, load.done - done0
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"model={model} A: {args.a_requests} requests, 8-token prompt, {args.a_max_tokens} tokens; "
          f"B: {args.b_concurrency} in flight, {args.b_prompt}-token prompts, 16 tokens; "
          f"serve {' '.join(args.serve_arg) or '(defaults)'}; scheduler {args.scheduler or 'current'}")
    print(f"{'A latency ms':<22} {'p50':>8} {'p95':>8} {'max':>8}")
    print(f"{'A alone':<22} {summary(alone)}")
    print(f"{'A under B':<22} {summary(loaded)}")
    print(f"B under it: {b_done / seconds:.1f} requests/s, {b_done * args.b_prompt / seconds:,.0f} prompt tokens/s")


if __name__ == "__main__":
    main()
