"""Several training runs on one base: one after another, taking turns, or batched into one pass
over the base per slice (issue 24; train/grouped.py), in the engine core's own code, no HTTP.

    python bench/train_group.py [--runs 1,3,8] [--steps 2] [--datums 8] [--tokens 64]
                                [--budget 512] [--rounds 3] [--threads 1] [--prepack]

`TrainerCore` on an `LLMEngine` of the demo base (rank 8 on attention, MLP and lm_head), each
run `--steps` steps of forward_backward over `--datums` datums of `--tokens` tokens, then
optim_step. Three ways for N runs:

- one after another: each run's steps to the end before the next run starts;
- turns: every run's pass begun at once, each slice one run's datums (`Pass.advance` alone: the
  core before batching), round robin;
- batched: the same, each slice through `TrainerCore.advance`, which takes the waiting runs'
  datums one each in turn up to `--budget` as one batch.

Wall time and this process's CPU time, each the best of `--rounds` (rounds interleave the three
ways; on a shared machine the CPU time is the steadier figure), and the peak bytes torch's CPU
allocator held in one more profiled run of each (the profiler's allocation events).
`--prepack`: the base's linears in oneDNN's packed layout (`--weight-prepack on`), whose
backward unpacks each weight once per slice (train/hooks.py): once for all runs when batched.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import time

import torch

from bench.train_long_datum import peak_bytes
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.training import TrainerCore

ADAM = {"learning_rate": 1e-4}


def _data(datums: int, tokens: int) -> list:
    toks = [(7 * i) % 250 + 1 for i in range(tokens + 1)]
    return [[toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * tokens}]] * datums


def _step(core: TrainerCore, runs: list[str], data: list, budget: int, batched: bool) -> None:
    """One step of every run in `runs`, their passes begun together, slices round robin."""
    for r in runs:
        core.begin(r, f"{r}#p", data, "cross_entropy", None, True, "default", 1.0)
    waiting = list(runs)
    while waiting:
        for r in list(waiting):
            if batched:
                done = core.advance(f"{r}#p", budget) is not None
            else:
                p = core.passes[f"{r}#p"]
                p.advance(budget)
                done = p.done and core.advance(f"{r}#p", budget) is not None  # finish only
            if done:
                waiting.remove(r)
    for r in runs:
        core.optim_step(r, ADAM)


def trial(core: TrainerCore, n: int, mode: str, args: argparse.Namespace) -> None:
    runs = [f"r{i}" for i in range(n)]
    for i, r in enumerate(runs):
        core.create(r, {"rank": 8, "seed": i})
    data = _data(args.datums, args.tokens)
    try:
        if mode == "one after another":
            for r in runs:
                for _ in range(args.steps):
                    _step(core, [r], data, args.budget, batched=False)
        else:
            for _ in range(args.steps):
                _step(core, runs, data, args.budget, batched=mode == "batched")
    finally:
        for r in runs:
            core.drop(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="1,3,8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prepack", action="store_true")
    args = ap.parse_args()
    from loraserve.demo import build_demo
    demo = build_demo(Path(".loraserve/demo"))
    core = TrainerCore(LLMEngine(EngineConfig(model_dir=str(demo.qwen3), device="cpu", torch_threads=args.threads,
                                              weight_prepack="on" if args.prepack else "off")))
    torch.set_num_threads(args.threads)
    modes = ("one after another", "turns", "batched")
    print(f"| runs | {' | '.join(f'{m} wall / CPU (s)' for m in modes)} | one after another / batched (CPU) |"
          f" {' | '.join(f'peak MiB {m}' for m in modes)} |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.runs.split(",")):
        trial(core, n, "batched", args)  # warm
        wall, cpu = ({m: float("inf") for m in modes} for _ in range(2))
        for _ in range(args.rounds):
            for m in modes:
                t0, c0 = time.perf_counter(), time.process_time()
                trial(core, n, m, args)
                wall[m] = min(wall[m], time.perf_counter() - t0)
                cpu[m] = min(cpu[m], time.process_time() - c0)
        peak = {m: peak_bytes(lambda m=m: trial(core, n, m, args)) / 2**20 for m in modes}
        print(f"| {n} | {' | '.join(f'{wall[m]:.2f} / {cpu[m]:.2f}' for m in modes)} |"
              f" {cpu[modes[0]] / cpu['batched']:.2f}x | {' | '.join(f'{peak[m]:.1f}' for m in modes)} |", flush=True)


if __name__ == "__main__":
    main()
