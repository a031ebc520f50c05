"""One decode step's linears at one row, float32 against bfloat16, per weight layout.

    python bench/gemv_dtypes.py [--reps 5] [--threads 2]

The fused linears of a Qwen3-0.6B-shaped step (28 layers of q/k/v, o, gate/up, down; every layer
its own weights, so they stream from memory as a model's do) at one row, in each dtype and
layout a CPU server can run them: `torch.mv` on the plain [out, in] weight (what
`--max-batch-size 1` serves), `F.linear` on it, and oneDNN's packed layout (what a batching
server serves, `loraserve.model.prepack`). All interleaved in each round, best of --reps; prints
ms and the achieved weight-read GB/s. It answers which layout `--weight-prepack auto` should
pick for one sequence at each dtype, and how much of bfloat16's halved bytes a step gets back.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}  # (in, out)
LAYERS = 28


def variants(dtype: torch.dtype) -> dict:
    """name -> (per-layer weights, call(weight, x), inputs by in-features, bytes of weights)."""
    weights = [{k: (torch.randn(o, i) / i ** 0.5).to(dtype) for k, (i, o) in SHAPES.items()}
               for _ in range(LAYERS)]
    xs = {i: torch.randn(1, i).to(dtype) for i, _ in SHAPES.values()}
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer.values())
    packed = [{k: torch.ops.mkldnn._reorder_linear_weight(w, 1) for k, w in layer.items()}
              for layer in weights]
    name = str(dtype).removeprefix("torch.")
    return {f"{name} torch.mv [out,in]": (weights, lambda w, x: torch.mv(w, x[0]), xs, nbytes),
            f"{name} F.linear [out,in]": (weights, lambda w, x: F.linear(x, w), xs, nbytes),
            f"{name} oneDNN packed (hint 1)": (
                packed, lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                xs, nbytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = {**variants(torch.float32), **variants(torch.bfloat16)}
    best = {name: float("inf") for name in runs}
    with torch.inference_mode():
        for _ in range(args.reps):  # interleaved: the machine's noise lands on every variant
            for name, (weights, call, xs, _) in runs.items():
                t0 = time.perf_counter()
                for layer in weights:
                    for k, w in layer.items():
                        call(w, xs[SHAPES[k][0]])
                best[name] = min(best[name], time.perf_counter() - t0)
    print(f"one row, {LAYERS} layers of fused 0.6B shapes, {args.threads} threads, best of {args.reps}")
    for name, (_, _, _, nbytes) in runs.items():
        print(f"{name:<30} {best[name] * 1e3:8.1f} ms  {nbytes / 1e9:.2f} GB  {nbytes / best[name] / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
