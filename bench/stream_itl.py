"""Inter-token latency of streamed completions at a few concurrencies, against one server.

    python bench/stream_itl.py --model DIR [--concurrency 1,4,32] [--duration 30] [-- serve args]

Starts `loraserve serve --model DIR` (engine core in its own process), then, per concurrency C,
runs `loraserve loadtest --concurrency C` (closed loop, streamed /v1/completions, greedy,
ignore_eos) and prints ITL p50/p99 (the gaps between a request's SSE text chunks: one chunk per
engine step when each token leaves the server in the step it was made), output tokens/s and
the time per token those tokens/s imply at C streams (C / tok/s), which ITL p50 should match
when nothing merges or holds back chunks.

First, one streamed request alone (`--check-tokens` new tokens, token ids per chunk from
`logprobs`): how many SSE chunks carried more than one token (a merged write), and the gaps
between chunk arrivals against the server's time per token. At one stream every chunk should
carry one token and leave in the step that made it.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hot_path.py, beside this script
sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time

import httpx

from hot_path import Server


def tokens_per_chunk(url: str, tokens: int, prompt: str = "The quick brown fox") -> None:
    """Stream one greedy completion alone; print tokens per SSE chunk and the arrival gaps."""
    body = {"model": "base", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    sizes, arrivals = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            for choice in httpx.Response(200, content=line[5:]).json().get("choices", ()):
                n = len((choice.get("logprobs") or {}).get("tokens") or ())
                if n:
                    sizes.append(n)
                    arrivals.append(time.perf_counter())
    gaps = [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:])]
    print(f"one stream, {sum(sizes)} tokens in {len(sizes)} chunks: {sum(n > 1 for n in sizes)} "
          f"chunks carried more than one token; gaps between chunks p50 "
          f"{statistics.median(gaps):.1f} ms, min {min(gaps):.1f}, max {max(gaps):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", default="1,4,32")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16, help="words")
    ap.add_argument("--check-tokens", type=int, default=32,
                    help="new tokens of the one-stream chunk check (0: skip it)")
    ap.add_argument("serve_args", nargs="*", help="extra `loraserve serve` arguments (after --)")
    args = ap.parse_args()
    from loraserve.loadtest import LoadTestConfig, run_loadtest

    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(Path(args.model).resolve()),
           "--log-level", "warning", "--no-prefix-caching", "--served-model-name", "base",
           *args.serve_args]
    server = Server("loraserve", cmd, "/health")
    try:
        print(f"model={args.model} max_tokens={args.max_tokens} serve args: {args.serve_args}")
        if args.check_tokens:
            tokens_per_chunk(server.url, args.check_tokens)
        print(f"{'streams':>8} {'tok/s':>8} {'C/tok/s ms':>11} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ok':>5}")
        run_loadtest(LoadTestConfig(url=server.url, concurrency=1, duration=3,
                                    max_tokens=4, prompt_len=args.prompt_len, progress=False))  # warm-up
        for c in (int(x) for x in args.concurrency.split(",")):
            rep = run_loadtest(LoadTestConfig(
                url=server.url, concurrency=c, duration=args.duration,
                max_tokens=args.max_tokens, prompt_len=args.prompt_len, progress=False, timeout=600))
            tps, itl = rep["output_tokens_per_s"], rep["itl_s"]
            per_token = 1e3 * c / tps if tps else float("nan")
            print(f"{c:>8} {tps:>8.1f} {per_token:>11.1f} {1e3 * itl['p50']:>11.1f} "
                  f"{1e3 * itl['p99']:>11.1f} {rep['ok']:>5}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
