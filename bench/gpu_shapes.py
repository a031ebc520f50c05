"""Decode at real model shapes on one device: eager against the compiled step (CUDA-graph replay),
base-only batches and a batch over many adapters, each as a fraction of the weight-read floor.

    python bench/gpu_shapes.py [--shapes smollm2,qwen3-0.6b] [--dtype bfloat16] [--batches 1,8,32]
                               [--adapters 32] [--tokens 64] [--device cuda]

The bases are random weights at the real models' shapes (SmolLM2-135M-Instruct: Llama, H 576,
30 layers, GQA 9/3 of 64, vocab 49,152, tied; Qwen3-0.6B: H 1,024, 28 layers, 16/8 heads of
128, vocab 151,936, tied): a decode step's time depends on the shapes, not on the values, and
the real files are too large to carry to a lent GPU. Adapters: rank 16 on all seven targets,
synthetic (`catalog materialize`), one per request in the mixed row.

The floor of a decode step is the bytes it must read once (every linear weight, the LM head,
and in the mixed row each distinct adapter's A and B) over the device's measured copy
bandwidth (a large device-to-device copy: read + write bytes / time). `floor` is floor ms /
step ms: 1.0 is the memory's limit; a launch-bound step sits far below it.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

import argparse
import logging
import shutil
import tempfile
import time

import torch

SHAPES = {
    "smollm2": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen3-0.6b": dict(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                       tie_word_embeddings=True),
    "tiny": dict(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=2, num_kv_heads=1, head_dim=32, tie_word_embeddings=True),  # a CPU smoke run
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16


def write_base(shape: str, dtype: torch.dtype, out: Path) -> None:
    """A random-weight checkpoint at `shape`'s dims in `dtype`, with the tiny byte-level tokenizer."""
    from loraserve.model.tiny import random_model, tiny_config, write_tokenizer_files
    from loraserve.model.writer import save_checkpoint

    config = tiny_config(**SHAPES[shape], max_position_embeddings=4096)
    save_checkpoint(random_model(config, seed=0).to(dtype), out)
    write_tokenizer_files(out)


def write_adapters(base: Path, catalog: Path, count: int) -> list[str]:
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.catalog.store import Catalog

    from loraserve.catalog.materialize_worker import adapter_id

    Catalog.create(catalog, shards=8).close()
    cfg = MaterializeConfig(catalog_dir=catalog, model_dir=base, count=count, rank=RANK, targets=TARGETS,
                            prefix="gpu/a", workers=1, progress=False)
    report = materialize(cfg)
    assert not report.errors and report.written == count, report
    return [adapter_id(cfg.prefix, i, cfg.width) for i in range(count)]


def floor_bytes(base: Path, adapters: int) -> tuple[int, int]:
    """(weight bytes a step reads, bytes of one adapter's factors) for the base at `base`."""
    from loraserve.catalog.base import BaseInfo

    info = BaseInfo.from_dir(base)
    cfg = SHAPES_BY_DIR[base]
    item = torch.empty((), dtype=DTYPE[0]).element_size()
    linear = sum(m.in_features * m.out_features for m in info.modules.values()) * item
    head = cfg["vocab_size"] * cfg["hidden_size"] * item
    per_adapter = sum(RANK * (m.in_features + m.out_features) for p, m in info.modules.items()
                      if any(t in p for t in TARGETS)) * item
    return linear + head, per_adapter


def copy_bandwidth(device: str) -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + written), best of 5."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def engine(base: Path, catalog: Path, compile: str, batches: list[int], adapters: int, tokens: int, device: str):
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine

    t0 = time.perf_counter()
    eng = build_engine(EngineConfig(model_dir=str(base), catalog_dir=str(catalog), device=device,
                                    dtype=DTYPE[1], max_batch_size=max(batches), max_model_len=64 + tokens,
                                    max_gpu_adapters=adapters, max_lora_rank=RANK, compile=compile,
                                    compile_batch_sizes=batches))
    graphs = eng.runner.graphs
    kind = f"{graphs.kind}, batches {sorted(graphs.ready) if hasattr(graphs, 'ready') else graphs.batch_sizes}" \
        if graphs is not None else "eager"
    print(f"# --compile {compile}: built in {time.perf_counter() - t0:.1f} s ({kind})", flush=True)
    return eng


def run_shape(shape: str, args, gbps: float) -> list[tuple]:
    from decode import measure

    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base, catalog = Path(tmp) / "base", Path(tmp) / "catalog"
        t0 = time.perf_counter()
        write_base(shape, DTYPE[0], base)
        ids = write_adapters(base, catalog, args.adapters)
        SHAPES_BY_DIR[base] = SHAPES[shape]
        weights, per_adapter = floor_bytes(base, args.adapters)
        print(f"# {shape}: base and {args.adapters} adapters written in {time.perf_counter() - t0:.1f} s; "
              f"{weights / 1e6:.0f} MB of weights a step reads, {per_adapter / 1e6:.2f} MB per adapter", flush=True)
        copy = Path(tmp) / "catalog-compiled"  # LMDB opens an environment once per process
        shutil.copytree(catalog, copy)
        engines = {"eager": engine(base, catalog, "off", batches, args.adapters, args.tokens, args.device),
                   "graph": engine(base, copy, "on", batches, args.adapters, args.tokens, args.device)}
        mixed = [ids[i % args.adapters] for i in range(max(batches))]
        cases = [(f"batch {b}", b, None) for b in batches] + [
            (f"batch {max(batches)}, {args.adapters} adapters", max(batches), mixed)]
        for eng in engines.values():
            measure(eng, 2, 16, 4, [ids[0], None])  # warm-up, pages an adapter in
            measure(eng, max(batches), 16, 4, mixed)  # pages every adapter in
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.repeats):  # interleaved, best of N
            for name, b, ads in cases:
                for mode, eng in engines.items():
                    _, ms = measure(eng, b, 16, args.tokens, ads)
                    best[(name, mode)] = min(best.get((name, mode), float("inf")), ms)
        for name, b, ads in cases:
            floor_ms = 1e3 * (weights + (per_adapter * args.adapters if ads else 0)) / (gbps * 1e9)
            e, g = best[(name, "eager")], best[(name, "graph")]
            rows.append((shape, name, e, g, e / g, floor_ms, floor_ms / g))
    return rows


SHAPES_BY_DIR: dict[Path, dict] = {}
DTYPE: list = [torch.bfloat16, "bfloat16"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    DTYPE[:] = [getattr(torch, args.dtype), args.dtype]
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    gbps = copy_bandwidth(args.device)
    print(f"# device {torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}, "
          f"copy bandwidth {gbps:.0f} GB/s, dtype {args.dtype}, {args.tokens} tokens, best of {args.repeats}")
    rows = [r for shape in args.shapes.split(",") for r in run_shape(shape, args, gbps)]
    print(f"| shape | case | eager ms/step | graph ms/step | graph/eager | floor ms | graph at floor |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape, name, e, g, speed, floor_ms, frac in rows:
        print(f"| {shape} | {name} | {e:.2f} | {g:.2f} | {speed:.2f}x | {floor_ms:.3f} | {frac:.0%} |", flush=True)


if __name__ == "__main__":
    main()
