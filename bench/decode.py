"""Decode throughput of the engine: tokens/s and per-step time at several batch sizes, one run.

    python bench/decode.py [--model DIR] [--batches 1,8,32,64] [--tokens 64] [--device auto]

Without --model it uses the demo base (built on first use under .loraserve/demo).
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import logging
import time
from pathlib import Path

import torch

from loraserve.engine.core.build import build_engine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.types import GenerateRequest, SamplingParams


def measure(eng: LLMEngine, batch: int, prompt_len: int, tokens: int,
            adapters: list[str | None] | None = None) -> tuple[float, float]:
    """Add `batch` requests, run their prefill, then time the decode steps: (tokens/s, ms/step)."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    adapters = adapters or [None] * batch
    for i in range(batch):
        prompt = torch.randint(3, eng.vocab_size - 3, (prompt_len,), generator=g).tolist()
        eng.add_request(GenerateRequest(f"b{batch}-{i}-{time.monotonic_ns()}", prompt, params, adapters[i]))
    while eng.scheduler.waiting or eng.scheduler.parked:  # prefill (and page-in) outside the timing
        eng.step()
    steps, generated = 0, 0
    t0 = time.perf_counter()
    while eng.has_work():
        generated += sum(len(o.token_ids) for o in eng.step())
        steps += 1
    dt = time.perf_counter() - t0
    return generated / dt, 1000 * dt / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off", "both"],
                    help="the engine's --compile; both: eager and compiled engines side by side, "
                         "interleaved per batch size, with their ratio")
    args = ap.parse_args()
    # DecodeGraphs.choose logs its start-up timing of each batch bucket (compiled against eager)
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    logging.getLogger("loraserve.engine.core.decode_graphs").setLevel(logging.INFO)
    model = base_or_demo(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    modes = ["off", "on"] if args.compile == "both" else [args.compile]
    engines = {}
    for mode in modes:
        t0 = time.perf_counter()
        engines[mode] = build_engine(EngineConfig(
            model_dir=model, device=args.device, dtype=args.dtype, max_batch_size=max(batches),
            max_model_len=args.prompt_len + args.tokens + 1, compile=mode,
            compile_batch_sizes=batches))
        graphs = engines[mode].runner.graphs
        print(f"# --compile {mode}: engine built in {time.perf_counter() - t0:.1f} s")
        if graphs is not None:
            print(f"# --compile {mode}: {graphs.kind}, {len(graphs.batch_sizes)} batch x "
                  f"{len(graphs.context_sizes)} context buckets")
            for b, (eager, compiled) in getattr(graphs, "timings", {}).items():
                print(f"#   start-up timing (DecodeGraphs.choose), batch bucket {b}: eager "
                      f"{eager * 1e3:.1f} ms, compiled {compiled * 1e3:.1f} ms -> "
                      f"{'eager' if b in graphs.eager_batches else 'compiled'}")
        measure(engines[mode], 2, args.prompt_len, 4)  # warm-up
    eng = engines[modes[0]]
    print(f"model={model} device={eng.device} dtype={eng.dtype} prompt={args.prompt_len} tokens={args.tokens}")
    head = "".join(f" {m + ' tok/s':>14} {m + ' ms/step':>14}" for m in modes)
    print(f"{'batch':>6}{head}" + (f" {'on/off':>7}" if len(modes) == 2 else ""))
    for b in batches:
        rows = [measure(engines[m], b, args.prompt_len, args.tokens) for m in modes]
        line = "".join(f" {tps:>14.1f} {ms:>14.2f}" for tps, ms in rows)
        print(f"{b:>6}{line}" + (f" {rows[1][0] / rows[0][0]:>6.2f}x" if len(modes) == 2 else ""),
              flush=True)


if __name__ == "__main__":
    main()
