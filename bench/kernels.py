"""Benchmark the SGMV LoRA op (`add_lora`: shrink + expand) against simple torch baselines.

For each (T tokens, number of distinct adapters) at H_in = H_out = 4096, rank 16, it prints the
time of `add_lora` (eager, and per CUDA-graph replay on CUDA), its achieved bandwidth (bytes that
must move: x, the live adapters' A and B rows, y read and written) against the measured
device-to-device copy bandwidth, and the speedup over (1) gather+bmm (each token's adapter
gathered from a dense [A, R, H] stack, then bmm) and (2) a per-adapter loop of two matmuls.
Timings only; nothing is asserted.

    python bench/kernels.py            # CUDA: triton backend, bfloat16; CPU: torch backend, float32
    python bench/kernels.py --quick    # smaller shapes (~1 minute on a 2-core CPU)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from loraserve.kernels import LoRAMeta, add_lora, resolve_backend  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class BenchConfig:
    """What to run: shapes, device, dtype, backend and repetitions."""

    hidden: int
    rank: int
    tokens: tuple[int, ...]
    adapters: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    backend: str
    reps: int

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.rank < 1 or self.reps < 1:
            raise ValueError("hidden, rank and reps must be positive")
        if not self.tokens or not self.adapters or min(self.tokens + self.adapters) < 1:
            raise ValueError("tokens and adapters need positive sizes")


def timed(fn, cfg: BenchConfig) -> float:
    """Best-of-`reps` seconds per call of `fn` after a warm-up (the best is the least noisy
    figure on a shared machine)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(cfg.reps):
        if cfg.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return min(samples)


def copy_bandwidth(cfg: BenchConfig) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), 256 MiB (CPU: 64 MiB)."""
    n = (256 if cfg.device.type == "cuda" else 64) << 20
    src = torch.empty(n, dtype=torch.uint8, device=cfg.device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), cfg) / 1e9


@dataclass(slots=True)
class Batch:
    """One benchmark batch in the pool layout plus dense copies for the baselines."""

    x: torch.Tensor  # [T, H]
    y: torch.Tensor  # [T, H]
    A_rows: torch.Tensor  # [P, H]
    B_rows: torch.Tensor  # [P, H]
    row_table: torch.Tensor  # [A, R] int32
    ranks: torch.Tensor  # [A] int32
    slots: torch.Tensor  # [T] int64
    A_dense: torch.Tensor  # [A, R, H]
    B_dense: torch.Tensor  # [A, H, R]
    groups: list[torch.Tensor]  # per adapter: its token ids
    meta: LoRAMeta


def make_batch(cfg: BenchConfig, t: int, n: int) -> Batch:
    on = dict(device=cfg.device, dtype=cfg.dtype)
    h, r = cfg.hidden, cfg.rank
    rows = torch.randperm(n * r, device=cfg.device).int().reshape(n, r)
    A_rows = torch.randn(n * r, h, **on) / h**0.5
    B_rows = torch.randn(n * r, h, **on) / r**0.5
    slots = torch.randperm(t, device=cfg.device) % n
    meta = LoRAMeta.build(slots.int(), max_segments=n)
    groups = [torch.nonzero(slots == a).flatten() for a in range(n)]
    return Batch(torch.randn(t, h, **on), torch.randn(t, h, **on), A_rows, B_rows, rows,
                 torch.full((n,), r, dtype=torch.int32, device=cfg.device), slots,
                 A_rows[rows.long()], B_rows[rows.long()].transpose(1, 2).contiguous(), groups,
                 meta)


def gather_bmm(b: Batch) -> None:
    v = torch.bmm(b.x.unsqueeze(1), b.A_dense[b.slots].transpose(1, 2))  # [T, 1, R]
    b.y += torch.bmm(v, b.B_dense[b.slots].transpose(1, 2)).squeeze(1)


def per_adapter_loop(b: Batch) -> None:
    for a, idx in enumerate(b.groups):
        b.y[idx] += (b.x[idx] @ b.A_dense[a].T) @ b.B_dense[a].T


def graph_time(fn, cfg: BenchConfig) -> str:
    """Milliseconds per CUDA-graph replay of `fn` (decode is launch-bound), '-' off CUDA."""
    if cfg.device.type != "cuda":
        return "-"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up (compile) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # reported, not fatal: the eager columns still stand
        print(f"# CUDA graph capture failed: {exc}", flush=True)
        return "n/a"
    return f"{timed(graph.replay, cfg) * 1e3:.3f}"


def bench_row(cfg: BenchConfig, t: int, n: int, copy_gbs: float) -> list[str]:
    b = make_batch(cfg, t, n)
    buffer = torch.empty(t, cfg.rank, dtype=torch.float32, device=cfg.device)

    def run() -> None:
        add_lora(b.y, b.x, b.A_rows, b.B_rows, b.row_table, b.ranks, b.meta,
                 backend=cfg.backend, buffer=buffer)

    ours = timed(run, cfg)
    graphed = graph_time(run, cfg)
    gather = timed(lambda: gather_bmm(b), cfg)
    loop = timed(lambda: per_adapter_loop(b), cfg)
    size = b.x.element_size()
    moved = size * (t * cfg.hidden * 3 + 2 * n * cfg.rank * cfg.hidden)
    gbs = moved / ours / 1e9
    return [str(t), str(n), f"{ours * 1e3:.3f}", graphed, f"{gbs:.1f}",
            f"{100 * gbs / copy_gbs:.0f}%", f"{gather * 1e3:.3f}", f"{gather / ours:.2f}x",
            f"{loop * 1e3:.3f}", f"{loop / ours:.2f}x"]


def call_overhead(cfg: BenchConfig, *, through_op: bool = False) -> float:
    """Seconds per add_lora call at a tiny decode shape (8 tokens, 8 adapters, H 64): overhead.
    through_op: call the registered custom op (what a torch.compile graph runs) instead."""
    small = BenchConfig(64, 8, (8,), (8,), cfg.device, cfg.dtype, cfg.backend, max(cfg.reps, 50))
    b = make_batch(small, 8, 8)
    if through_op:
        m = b.meta
        return timed(lambda: torch.ops.loraserve.add_lora(
            b.y, b.x, b.A_rows, b.B_rows, b.row_table, b.ranks, None, m.tensors(), m.num_tokens,
            m.moe, cfg.backend), small)
    return timed(lambda: add_lora(b.y, b.x, b.A_rows, b.B_rows, b.row_table, b.ranks, b.meta,
                                  backend=cfg.backend), small)


def graph_replay_check(cfg: BenchConfig) -> str:
    """Capture add_lora once, rebuild the meta for new slots into the same buffers, replay, and
    report the relative difference to an eager run (the CUDA-graph contract). CUDA only."""
    if cfg.device.type != "cuda":
        return "skipped (CPU)"
    t, n = 256, 16
    b = make_batch(cfg, t, n)
    meta = LoRAMeta.empty(t, n, cfg.device)
    LoRAMeta.build(b.slots.int(), max_segments=n, out=meta)
    y0, buffer = b.y.clone(), torch.empty(t, cfg.rank, device=cfg.device)

    def run() -> None:
        add_lora(b.y, b.x, b.A_rows, b.B_rows, b.row_table, b.ranks, meta, backend=cfg.backend,
                 buffer=buffer)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    new_slots = (torch.randperm(t, device=cfg.device) % (n + 1) - 1).int()  # some base-only
    LoRAMeta.build(new_slots, max_segments=n, out=meta)
    b.y.copy_(y0)
    graph.replay()
    replayed = b.y.clone()
    b.y.copy_(y0)
    run()
    err = ((replayed.float() - b.y.float()).abs().max() / b.y.float().abs().max()).item()
    return f"max relative difference to eager {err:.2e}"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes (about 1 minute on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--reps", type=int, default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    backend = resolve_backend(a.backend, device)
    if a.quick:
        return BenchConfig(1024, 16, (64, 256, 1024), (1, 16, 64), device, dtype, backend,
                           a.reps or 5)
    return BenchConfig(4096, 16, (64, 256, 4096), (1, 16, 64), device, dtype, backend,
                       a.reps or (50 if device.type == "cuda" else 5))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    copy_gbs = copy_bandwidth(cfg)
    print(f"# add_lora bench: device={cfg.device} backend={cfg.backend} dtype={cfg.dtype} "
          f"H_in=H_out={cfg.hidden} rank={cfg.rank}; copy bandwidth {copy_gbs:.1f} GB/s")
    header = ["T", "adapters", "ms", "graph ms", "GB/s", "%copy", "gather+bmm ms", "speedup",
              "loop ms", "speedup"]
    rows = [bench_row(cfg, t, n, copy_gbs) for t in cfg.tokens for n in cfg.adapters]
    print_table(header, rows)
    print(f"# per-call overhead (T=8, 8 adapters, H=64): {call_overhead(cfg) * 1e6:.0f} us")
    print(f"# the same through torch.ops.loraserve.add_lora (custom-op dispatch, as compiled "
          f"graphs call it): {call_overhead(cfg, through_op=True) * 1e6:.0f} us")
    print(f"# CUDA graph replay after a meta rebuild: {graph_replay_check(cfg)}")


if __name__ == "__main__":
    main()
