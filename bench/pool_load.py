"""Device-pool page-in cost: `AdapterPool.load` of a decoded adapter into the row layout, with
the eviction it forces, for bases of three sizes (one thread, float32), from a decoded adapter
and from a CPU-tier slab (`adapters.slabs`), and the whole cold page-in (decode into a slab +
pool load) against the floor set by bytes.

    .venv/bin/python bench/pool_load.py [--source DIR] [--rounds 3] [--device cpu|cuda]

`--source` imports loraserve from another checkout (A/B runs of two trees, alternately; a tree
without slabs prints the decoded column only). Columns: µs per load (median of rounds) from a
decoded adapter and from a slab; cold adapters/s = 1 / (decode into a slab + slab load); the
floor = the adapter's bytes over the measured copy bandwidth (CPU: memcpy of 64 MiB; CUDA: a
64 MiB pinned host-to-device copy). On CUDA the slabs are pinned and a load copies on the pool's
side stream: `overlap` is the share of the copies' time hidden under compute queued on the
compute stream (1.0: fully hidden), measured as (compute alone + copies alone - both) / the
shorter of the two.
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
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    if args.source:
        sys.path.insert(0, args.source)
    import torch

    from loraserve.adapters.pool import AdapterPool, PoolConfig
    from loraserve.adapters.targets import TargetSpec

    torch.set_num_threads(1)
    print(f"loraserve from {sys.modules['loraserve'].__file__}, device {args.device}")
    floor_bw = copy_bandwidth(args.device)
    print(f"copy bandwidth: {floor_bw / 1e9:.1f} GB/s ({'pinned host-to-device' if args.device == 'cuda' else 'memcpy'})")
    print("| base | adapter MB | µs/load decoded | µs/load slab | decode into slab µs | cold adapters/s "
          "| floor adapters/s (bytes) | overlap |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (layers, hidden, inter, kinds, rank) in CASES.items():
        specs = [TargetSpec(k, list(range(layers)), h_in=_size(DIMS[k][0], hidden, inter),
                            h_out=_size(DIMS[k][1], hidden, inter)) for k in kinds]
        adapters = _adapters(specs, kinds, rank)
        nbytes = sum(t.numel() * 4 for t in adapters[0].tensors.values())
        plain = _timed_loads(AdapterPool(specs, PoolConfig(max_slots=8, max_rank=16, device=args.device)),
                             adapters, args)
        row = [f"{name}", f"{nbytes / 2**20:.2f}", f"{plain:,.0f}"]
        try:
            from loraserve.adapters.slabs import Slabs  # a tree from before slabs has none
        except ImportError:
            print("| " + " | ".join(row + ["-"] * 5) + " |")
            continue
        pool = AdapterPool(specs, PoolConfig(max_slots=8, max_rank=16, device=args.device))
        slabs = Slabs.for_pool(pool, pin_memory=args.device == "cuda")
        decode_us, entries = _slab_decode(slabs, adapters, args.rounds)
        slab = _timed_loads(pool, entries, args)
        overlap = _overlap(pool, entries) if args.device == "cuda" else None
        row += [f"{slab:,.0f}", f"{decode_us:,.0f}", f"{1e6 / (decode_us + slab):,.0f}",
                f"{floor_bw / nbytes:,.0f}", "-" if overlap is None else f"{overlap:.2f}"]
        print("| " + " | ".join(row) + " |")


def _adapters(specs, kinds, rank: int) -> list:
    import torch

    from loraserve.adapters.targets import tensor_names
    from loraserve.catalog.layout import AdapterWeights

    gen = torch.Generator().manual_seed(0)
    adapters = []
    for _ in range(16):
        tensors = {}
        for s in specs:
            for layer in s.layers:
                a, b = tensor_names(s.kind, layer)
                tensors[a] = torch.randn(s.a_shape(rank), generator=gen) * 0.01
                tensors[b] = torch.randn(s.b_shape(rank), generator=gen) * 0.01
        adapters.append(AdapterWeights("fp", rank, kinds, torch.float32, tensors))
    return adapters


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_loads(pool, adapters: list, args) -> float:
    """µs per `pool.load` into a full pool (each load evicts one), median of rounds."""
    for i in range(8):
        pool.load(("warm", str(i)), adapters[i % len(adapters)])
    times = []
    for r in range(args.rounds):
        _sync(args.device)
        t0 = time.perf_counter()
        for i in range(args.loads):
            pool.load(("r", f"{time.perf_counter_ns()}-{i}"), adapters[i % len(adapters)])
        _sync(args.device)
        times.append((time.perf_counter() - t0) / args.loads * 1e6)
    return statistics.median(times)


def _slab_decode(slabs, adapters: list, rounds: int) -> tuple[float, list]:
    """µs per page-in decode of a blob into a slab (`checked_region` + `Slabs.convert`)."""
    from loraserve.catalog.layout import checked_region, save_revision

    blobs = [save_revision(w) for w in adapters]
    times, entries = [], []
    for _ in range(rounds):
        fresh = [bytearray(b) for b in blobs]  # a page-in's blob is its own copy
        t0 = time.perf_counter()
        entries = [slabs.convert(b, *checked_region(b)) for b in fresh]
        times.append((time.perf_counter() - t0) / len(fresh) * 1e6)
    return statistics.median(times), entries


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 64 MiB copy: memcpy on the CPU, pinned host-to-device on CUDA (best of 10)."""
    import torch

    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(10):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return n / best


def _overlap(pool, entries: list) -> float:
    """CUDA: the share of slab loads' copy time hidden under compute already queued."""
    import torch

    x = torch.randn(4096, 4096, device="cuda")

    def compute():
        for _ in range(20):
            x @ x

    def copies():
        for i in range(64):
            pool.load(("o", f"{time.perf_counter_ns()}-{i}"), entries[i % len(entries)])

    def timed(*fns) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(compute, copies)  # warm-up
    alone_c, alone_k, both = timed(compute), timed(copies), timed(compute, copies)
    return max(0.0, alone_c + alone_k - both) / min(alone_c, alone_k)

if __name__ == "__main__":
    main()
