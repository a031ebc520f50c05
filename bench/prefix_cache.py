"""Prefix caching: prefill time of requests that share a long system prompt, cache on vs off.

    python bench/prefix_cache.py [--model DIR] [--prefix 256] [--suffix 16] [--batch 16] [--adapter ID --catalog DIR]

One engine, one run. A first request computes the shared prefix (and registers its blocks);
then `--batch` requests with the same prefix and distinct suffixes are prefilled together,
timed from submission until every one has its first token. The same wave runs with prefix
caching switched off (on the same engine, fresh suffixes each time), interleaved, best of 3.
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


def wave(eng: LLMEngine, prefix: list[int], suffixes: list[list[int]], adapter: str | None) -> float:
    """Seconds from submitting the wave until every request has its first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, s in enumerate(suffixes):
        eng.add_request(GenerateRequest(f"w{time.monotonic_ns()}-{i}", prefix + s, params, adapter))
    while eng.has_work():
        eng.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--catalog", default=None)
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    model = base_or_demo(args.model)
    cfg = EngineConfig(model_dir=model, device=args.device, catalog_dir=args.catalog, max_batch_size=args.batch,
                       max_model_len=args.prefix + args.suffix + 8)
    if args.catalog:
        from loraserve.engine.core.build import build_engine
        eng = build_engine(cfg)
    else:
        eng = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, eng.vocab_size - 3, (n,), generator=g).tolist()  # noqa: E731
    prefix = rand(args.prefix)
    wave(eng, prefix, [rand(args.suffix)], args.adapter)  # computes and registers the prefix
    best = {True: float("inf"), False: float("inf")}
    for _ in range(3):
        for on in (True, False):
            eng.blocks.prefix_caching = on
            best[on] = min(best[on], wave(eng, prefix, [rand(args.suffix) for _ in range(args.batch)], args.adapter))
    eng.blocks.prefix_caching = True
    print(f"model={model} adapter={args.adapter} prefix={args.prefix} suffix={args.suffix} batch={args.batch} "
          f"device={eng.device}")
    print(f"{'prefix caching':>15} {'wave ms':>9} {'prompt tok/s':>13}")
    tokens = args.batch * (args.prefix + args.suffix)
    for on in (False, True):
        print(f"{'on' if on else 'off':>15} {best[on] * 1e3:>9.1f} {tokens / best[on]:>13.0f}")
    print(f"{'speedup':>15} {best[False] / best[True]:>9.2f}x   (hit rate since start: "
          f"{eng.stats()['prefix_cache_hit_rate']:.2f})")


if __name__ == "__main__":
    main()
