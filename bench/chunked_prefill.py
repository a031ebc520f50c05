"""Chunked prefill: how long running requests stall while a long prompt arrives.

    python bench/chunked_prefill.py [--model DIR] [--running 8] [--prompt 2000] [--chunks 4096,512,128]

`--running` requests are decoding when one request with a `--prompt`-token prompt arrives. For
each `max_batched_tokens` setting the table shows the longest gap between two consecutive tokens
of the running requests while the long prompt is prefilled (the stall), the long request's time
to first token, and the running requests' mean time per output token over the whole episode.
One engine per setting, same prompts, best of 3.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import time

import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.types import GenerateRequest, SamplingParams


def episode(eng: LLMEngine, shorts: list[list[int]], long: list[int]) -> tuple[float, float, float]:
    """(max gap between a running request's tokens, long request's TTFT, mean s/token) in seconds."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    running = [eng.add_request(GenerateRequest(f"s{time.monotonic_ns()}-{i}", p, params))
               for i, p in enumerate(shorts)]
    while any(not s.output_ids for s in running):
        eng.step()
    for _ in range(3):
        eng.step()
    big = eng.add_request(GenerateRequest(f"l{time.monotonic_ns()}", long,
                                          SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    t0 = last = time.perf_counter()
    gap, ttft, n0 = 0.0, None, len(running[0].output_ids)
    while ttft is None or len(running[0].output_ids) < n0 + 20:
        before = len(running[0].output_ids)
        eng.step()
        now = time.perf_counter()
        if ttft is None and big.output_ids:
            ttft = now - t0
        if len(running[0].output_ids) > before:
            gap, last = max(gap, now - last), now
    per_token = (time.perf_counter() - t0) / (len(running[0].output_ids) - n0)
    for s in running:
        eng.abort(s.request_id)
    while eng.has_work():
        eng.step()
    return gap, ttft, per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--running", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--chunks", default="4096,512,128")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    model = base_or_demo(args.model)
    print(f"model={model} running={args.running} long prompt={args.prompt} tokens")
    print(f"{'max_batched_tokens':>19} {'max stall ms':>13} {'long TTFT ms':>13} {'ms/token (running)':>19}")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        eng = LLMEngine(EngineConfig(model_dir=model, device=args.device, max_batch_size=args.running + 1,
                                     max_model_len=args.prompt + 256, max_batched_tokens=chunk,
                                     prefix_caching=False))
        g = torch.Generator().manual_seed(0)
        shorts = [torch.randint(3, eng.vocab_size - 3, (16,), generator=g).tolist() for _ in range(args.running)]
        long = torch.randint(3, eng.vocab_size - 3, (args.prompt,), generator=g).tolist()
        runs = [episode(eng, shorts, long) for _ in range(3)]
        gap, ttft, per = (min(r[i] for r in runs) for i in range(3))
        print(f"{chunk:>19} {gap * 1e3:>13.1f} {ttft * 1e3:>13.1f} {per * 1e3:>19.2f}")


if __name__ == "__main__":
    main()
