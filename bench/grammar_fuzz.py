"""The grammar fuzzer's long run (issue 43): generated schemas (depth, breadth, patterns, $refs:
tests/server/test_grammar_containment.py `fuzz_schema`) sent by one tenant against a live server
(an in-process one over the fake engine, or `--url` of a running `loraserve serve`), while
/health and another tenant's completions are timed. Prints the attacking requests' outcomes and
the others' latency (p50, p99, max). Never asserts: the bounded run is that test.

    python bench/grammar_fuzz.py [--minutes 5] [--seed 43] [--attackers 6]
        [--url http://host:8000 --model-a acme/x --model-b beta/y --key-a K --key-b K]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import argparse
import random
import statistics
import threading
import time
from collections import Counter, defaultdict
from contextlib import nullcontext

import httpx

from server.test_grammar_containment import fuzz_schema


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--attackers", type=int, default=6)
    ap.add_argument("--url")
    ap.add_argument("--model-a", default="acme/support")
    ap.add_argument("--model-b", default="beta/chat")
    ap.add_argument("--key-a", default="unused")
    ap.add_argument("--key-b", default="unused")
    args = ap.parse_args()
    if args.url:
        live, url = nullcontext(), args.url
    else:
        from loraserve.server import build_app
        from server.fake_engine import FakeEngine
        from server.live import LiveServer
        live = LiveServer(build_app(FakeEngine(adapters=(args.model_a, args.model_b),
                                               max_model_len=1 << 16)))
    with live as server:
        url = args.url or server.url
        report(*fuzz(url, args))


def fuzz(url: str, args):
    outcomes: Counter = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    stop, lock = threading.Event(), threading.Lock()
    rng = random.Random(args.seed)

    def attacker() -> None:
        with httpx.Client(base_url=url, timeout=300,
                          headers={"Authorization": f"Bearer {args.key_a}"}) as http:
            while not stop.is_set():
                with lock:
                    schema = fuzz_schema(rng)
                r = http.post("/v1/completions", json={
                    "model": args.model_a, "prompt": "x", "max_tokens": 4, "response_format": {
                        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
                with lock:
                    outcomes[f"{r.status_code} {r.json().get('error', {}).get('code', '')}".strip()] += 1

    def watcher(kind: str) -> None:
        with httpx.Client(base_url=url, timeout=300,
                          headers={"Authorization": f"Bearer {args.key_b}"}) as http:
            while not stop.is_set():
                t0 = time.perf_counter()
                if kind == "health":
                    http.get("/health")
                else:
                    http.post("/v1/completions", json={"model": args.model_b, "prompt": "x",
                                                       "max_tokens": 2})
                with lock:
                    latency[kind].append(time.perf_counter() - t0)
                time.sleep(0.05)

    threads = [threading.Thread(target=attacker) for _ in range(args.attackers)]
    threads += [threading.Thread(target=watcher, args=(k,)) for k in ("health", "other tenant")]
    for t in threads:
        t.start()
    time.sleep(args.minutes * 60)
    stop.set()
    for t in threads:
        t.join()
    return outcomes, latency


def report(outcomes: Counter, latency: dict[str, list[float]]) -> None:
    print(f"{'attacking requests':32} {'n':>7}")
    for key, n in sorted(outcomes.items()):
        print(f"{key:32} {n:7d}")
    print(f"\n{'others':14} {'n':>6} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for kind, xs in sorted(latency.items()):
        xs = sorted(xs)
        print(f"{kind:14} {len(xs):6d} {statistics.median(xs):8.3f} "
              f"{xs[min(len(xs) - 1, int(len(xs) * 0.99))]:8.3f} {xs[-1]:8.3f}")


if __name__ == "__main__":
    main()
