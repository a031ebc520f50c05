"""Tiny training steps through the Tinker SDK: what a step costs besides its compute (issue 24).

    python bench/train_steps.py [--steps 30] [--rounds 3] [--tokens 8] [--source DIR]...

One `loraserve serve` (engine-core process) per tree on the demo base (this tree, and each
`--source`: `git archive` of an older commit unpacked), each driving one run (rank 8 on every
layer's attention, MLP and lm_head) through `--steps` steps of forward_backward on one datum of
`--tokens` tokens then optim_step, waiting for each step's answer: the SFT loop at its smallest,
where what a step costs beyond its compute (its resume state, written for a core restart) shows.
Rounds interleave the trees (A B A B ...); the table gives each tree's best and median steps/s
and the ratio of the bests.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TINKER_TELEMETRY", "0")
import mint  # noqa: E402
from mint import types  # noqa: E402

from bench.train_serve import RANK, free_port, serve, sft_datum  # noqa: E402


def steps_per_s(url: str, steps: int, tokens: int, seed: int) -> float:
    service = mint.ServiceClient(base_url=url, api_key="tml-bench")
    trainer = service.create_lora_training_client(base_model="qwen3", rank=RANK, seed=seed)
    datum = sft_datum(tokens)
    trainer.forward_backward([datum], "cross_entropy").result()  # first-use costs out of the timing
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--source", metavar="DIR", action="append", default=[])
    args = ap.parse_args()
    from loraserve.demo import build_demo
    demo = build_demo(Path(".loraserve/demo"))
    trees = [None, *args.source]
    rates: dict[str | None, list[float]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for i, tree in enumerate(trees):
                root = Path(tmp) / f"t{i}"
                shutil.copytree(demo.catalog, root / "catalog")
                port = free_port()
                servers[tree] = (serve(demo.qwen3, root / "catalog", root, port, 512, tree), port)
            for r in range(args.rounds):
                for tree in trees:  # interleaved: the machine's load hits every tree alike
                    rates[tree].append(steps_per_s(f"http://127.0.0.1:{servers[tree][1]}", args.steps,
                                                   args.tokens, r))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    best = max(rates[None])
    print(f"| tree | steps/s best of {args.rounds} | steps/s median | this tree / tree (best) |")
    print("|---|---|---|---|")
    for tree in trees:
        print(f"| {tree or 'this tree'} | {max(rates[tree]):.1f} | {statistics.median(rates[tree]):.1f} |"
              f" {best / max(rates[tree]):.2f}x |")


if __name__ == "__main__":
    main()
