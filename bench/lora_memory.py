"""How much of a decode step the LoRA weights alone cost on this CPU, with no engine around them.

    python bench/lora_memory.py [--model DIR] [--adapters 1,8,32] [--rank 16] [--batch 32]

For each target of every layer of the base (shapes from its config.json), one decode step runs the
base GEMM `y = x @ W^T` and then the LoRA delta exactly as the torch backend's copy-free padded
path does (`bmm` shrink, `baddbmm_` expand over `[S, r, H]` views of one pool per target). Every
pool is distinct, as in the engine, so the step streams all of the adapters' weights. It prints
the ms per step of the base GEMMs alone, of base + LoRA, and the LoRA bytes read per step. It is a
floor for what the engine can reach: no attention, sampling or Python around the ops.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def target_shapes(cfg: dict) -> list[tuple[int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    return layer * cfg["num_hidden_layers"]


def step_ms(shapes, weights, pools, batch: int, adapters: int, rank: int, repeats: int) -> float:
    xs = {w: torch.randn(batch, w) for w in {s[0] for s in shapes}}
    ys = {w: torch.randn(batch, w) for w in {s[1] for s in shapes}}
    per = batch // adapters

    def step() -> None:
        for (h_in, h_out), W, pool in zip(shapes, weights, pools):
            x, y = xs[h_in], ys[h_out]
            torch.mm(x, W.T, out=y)
            if pool is not None:
                A, B = pool
                h = torch.bmm(x.view(adapters, per, h_in), A.view(adapters, rank, h_in).transpose(1, 2))
                y.view(adapters, per, h_out).baddbmm_(h, B.view(adapters, rank, h_out))

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".loraserve/demo/qwen3")
    ap.add_argument("--adapters", default="1,8,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    shapes = target_shapes(cfg)
    weights = [torch.randn(h_out, h_in) for h_in, h_out in shapes]
    base_mib = sum(w.numel() for w in weights) * 4 / 2**20
    base = step_ms(shapes, weights, [None] * len(shapes), args.batch, 1, args.rank, args.repeats)
    print(f"{args.model}: {len(shapes)} targets, base GEMM weights {base_mib:.1f} MiB, batch {args.batch}, "
          f"rank {args.rank}, float32, {args.threads} thread(s)")
    print(f"{'adapters':>9} {'LoRA MiB/step':>14} {'ms/step':>8} {'base only':>10} {'ratio':>6}")
    for n in [int(a) for a in args.adapters.split(",")]:
        pools = [(torch.randn(n * args.rank, h_in), torch.randn(n * args.rank, h_out)) for h_in, h_out in shapes]
        mib = sum(a.numel() + b.numel() for a, b in pools) * 4 / 2**20
        ms = step_ms(shapes, weights, pools, args.batch, n, args.rank, args.repeats)
        print(f"{n:>9} {mib:>14.1f} {ms:>8.2f} {base:>10.2f} {base / ms:>6.2f}")


if __name__ == "__main__":
    main()
