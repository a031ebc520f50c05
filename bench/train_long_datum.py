"""One long datum's forward_backward, whole against split into chunks of --train-max-tokens
(loraserve/train/chunked.py): peak memory torch's CPU allocator held (the profiler's allocation
events), the longest slice (what one training slice holds serving back by) and the whole pass.

    python bench/train_long_datum.py [--lengths 256,1024,2048] [--budget 256]

On the demo base (H 128, 4 layers, V 259), rank 8 on attention, MLP and lm_head, one thread.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from loraserve.model.loader import load_model
from loraserve.train.config import RunConfig
from loraserve.train.run import Datum, TrainingRun


def peak_bytes(fn) -> int:
    """Peak bytes torch's CPU allocator held over `fn` (allocation events in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def datum(n: int) -> Datum:
    toks = torch.tensor([(7 * i) % 250 + 1 for i in range(n + 1)])
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": torch.ones(n)})


def slices(run: TrainingRun, n: int, budget: int) -> list[float]:
    """Seconds of each slice of one forward_backward over a datum of n tokens."""
    p, times = run.start([datum(n)], "cross_entropy"), []
    done = False
    while not done:
        t0 = time.perf_counter()
        done = p.advance(budget)
        times.append(time.perf_counter() - t0)
    p.finish()
    run.grads = None
    return times


def peak_of_pass(run: TrainingRun, n: int, budget: int) -> float:
    """Peak MiB of one forward_backward over a datum of n tokens in slices of `budget`."""
    p = run.start([datum(n)], "cross_entropy")

    def drain() -> None:
        while not p.advance(budget):
            pass
    peak = peak_bytes(drain) / 2**20
    run.grads = None
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from loraserve.demo import build_demo
    run = TrainingRun(load_model(build_demo(Path(".loraserve/demo")).qwen3), RunConfig(rank=8))
    print(f"| datum tokens | peak MiB whole | peak MiB split ({args.budget}) | longest slice whole (ms) |"
          " longest slice split (ms) | pass whole (ms) | pass split (ms) |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        mem = [peak_of_pass(run, n, budget) for budget in (n, args.budget)]
        whole, split = slices(run, n, n), slices(run, n, args.budget)
        print(f"| {n} | {mem[0]:.1f} | {mem[1]:.1f} | {max(whole) * 1e3:.0f} | {max(split) * 1e3:.0f} |"
              f" {sum(whole) * 1e3:.0f} | {sum(split) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
