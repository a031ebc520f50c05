"""Device-pool page-in cost: `AdapterPool.load` of a decoded adapter into the row layout, with
the eviction it forces, for bases of three sizes (CPU, one thread, float32).

    .venv/bin/python bench/pool_load.py [--source DIR] [--rounds 3]

`--source` imports loraserve from another checkout (A/B runs of two trees, alternately).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

DIMS = {"q_proj": (1, 1), "k_proj": (1, 0.5), "v_proj": (1, 0.5), "o_proj": (1, 1),
        "gate_proj": (1, "I"), "up_proj": (1, "I"), "down_proj": ("I", 1)}
ALL7 = list(DIMS)
CASES = {  # name -> (layers, hidden, intermediate, kinds, rank)
    "demo base, rank 1 on q/v, 4 layers": (4, 128, 384, ["q_proj", "v_proj"], 1),
    "H 512, rank 16 on all 7, 8 layers": (8, 512, 1536, ALL7, 16),
    "H 1024, rank 16 on all 7, 28 layers": (28, 1024, 3072, ALL7, 16),
}


def _size(factor, hidden: int, inter: int) -> int:
    return inter if factor == "I" else int(hidden * factor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="import loraserve from this checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", type=int, default=48, help="timed loads per case and round")
    args = ap.parse_args()
    if args.source:
        sys.path.insert(0, args.source)
    import torch

    from loraserve.adapters.pool import AdapterPool, PoolConfig
    from loraserve.adapters.targets import TargetSpec, tensor_names
    from loraserve.catalog.layout import AdapterWeights

    torch.set_num_threads(1)
    print(f"loraserve from {sys.modules['loraserve'].__file__}")
    print("| base | adapter MB | µs per load (median of rounds) |")
    print("|---|---:|---:|")
    for name, (layers, hidden, inter, kinds, rank) in CASES.items():
        specs = [TargetSpec(k, list(range(layers)), h_in=_size(DIMS[k][0], hidden, inter),
                            h_out=_size(DIMS[k][1], hidden, inter)) for k in kinds]
        gen = torch.Generator().manual_seed(0)
        adapters = []
        for _ in range(16):
            tensors = {}
            for s in specs:
                for layer in s.layers:
                    a, b = tensor_names(s.kind, layer)
                    tensors[a] = torch.randn(s.a_shape(rank), generator=gen)
                    tensors[b] = torch.randn(s.b_shape(rank), generator=gen)
            adapters.append(AdapterWeights("fp", rank, kinds, torch.float32, tensors))
        mb = sum(t.numel() * 4 for t in adapters[0].tensors.values()) / 2**20
        pool = AdapterPool(specs, PoolConfig(max_slots=8, max_rank=16))
        for i in range(8):  # full: every timed load evicts one
            pool.load(("warm", str(i)), adapters[i])
        times = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for i in range(args.loads):
                pool.load(("r", f"{r}-{i}"), adapters[i % len(adapters)])
            times.append((time.perf_counter() - t0) / args.loads * 1e6)
        print(f"| {name} | {mb:.2f} | {statistics.median(times):,.0f} |")


if __name__ == "__main__":
    main()
