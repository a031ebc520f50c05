"""Where a cold request's extra time goes, stage by stage, in process (issue 29), one run.

    python bench/cold_path.py --catalog DIR [--model DIR] [--source DIR] [--batches 40]

A page-in's stages, each timed alone on adapters never seen before (µs per adapter):

  resolve      the catalog lookup a request's model name costs (API process), through the
               shard hosts (`IsolatedCatalog`, what a server runs) and in process (`Catalog`)
  read         `read_blobs` of a pager batch of 16, the same two ways (engine core, pager thread)
  decode       `load_revision` with the page-in's checks (finite values, factor bound) and without
  cpu tier     `CpuCache.put` (and, where the tree has them, its slabs)
  pool load    `AdapterPool.load` into a full pool (each load evicts)
  floor        the adapter's bytes over this machine's measured memcpy bandwidth

then the engine itself (`LLMEngine`, 32-request batches of 2-token requests, each batch naming
32 adapters it has never seen, against 32 resident adapters): wall and process CPU per request,
cold minus warm. `--source DIR` imports loraserve from another tree (A/B runs of two trees).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

BATCH = 16


def _med_us(fn, n: int, reps: int = 5) -> float:
    """Median over reps of fn's time / n, in µs."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def ids_after(catalog, start: int, n: int) -> list[str]:
    ids, after = [], None
    while len(ids) < start + n:
        page = catalog.list(limit=min(10_000, start + n - len(ids)), after=after)
        if not page:
            break
        ids += [p.adapter_id for p in page]
        after = page[-1].adapter_id
    return ids[start:start + n]


def catalog_stages(path: str, rows: list) -> list:
    """resolve and read, through the shard hosts and in process; returns the records read."""
    from loraserve.catalog.isolated import IsolatedCatalog
    from loraserve.catalog.store import Catalog

    records = None
    with Catalog.open(path, readonly=True) as plain:
        fresh = iter(range(0, 10**7, 4000))
        for name, cat in (("shard hosts", IsolatedCatalog(path, readonly=True)), ("in process", plain)):
            ids = ids_after(plain, next(fresh), 5 * 400)
            chunks = iter([ids[i:i + 400] for i in range(0, len(ids), 400)])
            rows.append((f"resolve ({name})", _med_us(lambda: [cat.resolve(i) for i in next(chunks)], 400)))
            recs = [plain.resolve(i) for i in ids_after(plain, next(fresh), 5 * BATCH * 25)]
            groups = iter([recs[i:i + BATCH] for i in range(0, len(recs), BATCH)])
            rows.append((f"read, batches of {BATCH} ({name})",
                         _med_us(lambda: [cat.read_blobs(next(groups)) for _ in range(25)], BATCH * 25)))
            records = records or recs
            if cat is not plain:
                cat.close()
    return records


def decode_stages(path: str, records: list, rows: list) -> list:
    """decode with and without the page-in checks; returns decoded weights."""
    from loraserve.catalog.layout import load_revision
    from loraserve.catalog.store import Catalog

    with Catalog.open(path, readonly=True) as cat:
        blobs = cat.read_blobs(records)
    n = len(blobs)
    rows.append(("decode, page-in checks (finite, factor bound)",
                 _med_us(lambda: [load_revision(bytearray(b), finite=True, compute_dtype="float32")
                                  for b in blobs], n)))
    rows.append(("decode, no value checks",
                 _med_us(lambda: [load_revision(bytearray(b)) for b in blobs], n)))
    rows.append(("  of which the blob copy (bytearray)", _med_us(lambda: [bytearray(b) for b in blobs], n)))
    return [load_revision(bytearray(b), finite=True) for b in blobs], blobs


def tier_stages(weights: list, blobs: list, model: str, rows: list) -> None:
    """CPU-tier put and device-pool load (full pool, each load evicting), and the bytes floor."""
    import torch

    from loraserve.adapters.cpu_cache import CpuCache
    from loraserve.adapters.pool import AdapterPool, PoolConfig
    from loraserve.adapters.targets import TargetSpec
    from loraserve.model.config import ModelConfig

    cache = CpuCache(256 * 2**20)
    keys = iter(range(10**9))
    rows.append(("cpu tier put", _med_us(lambda: [cache.put(("a", str(next(keys))), w) for w in weights],
                                         len(weights))))
    cfg = ModelConfig.from_dir(model)
    layers = list(range(cfg.num_layers))
    specs = [TargetSpec("q_proj", layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim),
             TargetSpec("v_proj", layers, cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)]
    pool = AdapterPool(specs, PoolConfig(max_slots=64, max_rank=64))
    for i in range(64):
        pool.load(("w", str(i)), weights[i % len(weights)])
    rows.append(("pool load (full pool: evicts one)",
                 _med_us(lambda: [pool.load(("p", str(next(keys))), w) for w in weights], len(weights))))
    try:
        from loraserve.adapters.slabs import Slabs
        from loraserve.catalog.layout import checked_region
    except ImportError:  # a tree from before the slabs
        Slabs = None
    if Slabs is not None:
        slabs = Slabs.for_pool(pool)
        fresh = lambda: [bytearray(b) for b in blobs]  # noqa: E731 (a page-in's blob is its own)
        rows.append(("decode into a CPU-tier slab (same checks)", _med_us(
            lambda: [slabs.convert(b, *checked_region(b, compute_dtype="float32")) for b in fresh()],
            len(blobs))))
        entries = [slabs.convert(b, *checked_region(b)) for b in fresh()]
        rows.append(("pool load from a slab (full pool)", _med_us(
            lambda: [pool.load(("s", str(next(keys))), e) for e in entries], len(entries))))
    nbytes = statistics.median(len(b) for b in blobs)
    src, dst = torch.empty(64 * 2**20, dtype=torch.uint8), torch.empty(64 * 2**20, dtype=torch.uint8)
    t = min(_timed(lambda: dst.copy_(src)) for _ in range(10))
    bw = src.numel() / t
    rows.append((f"floor: {nbytes:,.0f} B blob / memcpy {bw / 1e9:.1f} GB/s", nbytes / bw * 1e6))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def engine_stage(path: str, model: str, batches: int, rows: list) -> None:
    """The engine in process: µs of wall and process CPU per request, warm and cold batches."""
    from loraserve.catalog.store import Catalog
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import SamplingParams

    engine = build_engine(EngineConfig(model_dir=model, catalog_dir=path, catalog_readonly=True,
                                       max_gpu_adapters=64, cpu_cache_mb=256, compile="off"))
    with Catalog.open(path, readonly=True) as cat:
        ids = ids_after(cat, 200_000, 32 * (batches + 1))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [[1, 2, 3, 4]] * 32
    warm = ids[:32]
    try:
        engine.generate(prompt, params, warm)
        for name, sets in (("warm", [warm] * batches),
                           ("cold", [ids[32 * (b + 1):32 * (b + 2)] for b in range(batches)])):
            w0, c0 = time.perf_counter(), time.process_time()
            for adapters in sets:
                engine.generate(prompt, params, adapters)
            n = 32 * batches
            rows.append((f"engine in process, {name}: wall per request",
                         (time.perf_counter() - w0) / n * 1e6))
            rows.append((f"engine in process, {name}: process CPU per request",
                         (time.process_time() - c0) / n * 1e6))
    finally:
        engine.adapters.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--source", help="import loraserve from this tree")
    ap.add_argument("--batches", type=int, default=40, help="engine: 32-request batches per pass")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    if args.source:
        sys.path.insert(0, str(Path(args.source).resolve()))
    else:
        sys.path.append(str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from _common import base_or_demo  # bench/_common.py, beside this script

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = base_or_demo(args.model)
    print(f"loraserve from {sys.modules['loraserve'].__file__}")
    rows: list[tuple[str, float]] = []
    records = catalog_stages(args.catalog, rows)
    weights, blobs = decode_stages(args.catalog, records, rows)
    tier_stages(weights, blobs, model, rows)
    if not args.skip_engine:
        engine_stage(args.catalog, model, args.batches, rows)
    print("| stage | µs per adapter (or request) |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:,.1f} |")


if __name__ == "__main__":
    main()
