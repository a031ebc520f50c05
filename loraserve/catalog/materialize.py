"""`loraserve catalog materialize`: N synthetic adapter revisions for a base, in worker processes.

Ids are `{prefix}{i:07d}` for i in 0..N-1 (wider when N needs it); worker w owns the shards
s with s % workers == w, so no two processes write one shard. Safe to kill at any moment:
each batch is one LMDB txn of whole adapters, and a rerun of the same command skips what
exists, finishing with exactly N adapters under the prefix and no duplicates. With `store`
(`--store s3://bucket/prefix`) each worker also publishes every batch it commits into that
durable tier, resumably (catalog.store_materialize); with `store_only` as well, the workers build
into the store alone and the local catalog keeps nothing (a bounded local footprint).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .base import BaseInfo
from .dtypes import SERVING_DTYPES
from .ids import validate_adapter_id
from .materialize_worker import WorkerJob, adapter_id, run_worker
from .shards import MiB
from .store import Catalog
from .synth import build_template, target_modules
from .targets import parse_targets


@dataclass(slots=True)
class MaterializeConfig:
    """One materialize run. `count` adapters of rank `rank` on `targets`, ids `prefix` + index."""

    catalog_dir: Path
    model_dir: Path
    count: int
    rank: int = 1
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    prefix: str = "synth/a"
    workers: int = 2
    seed: int = 0
    dtype: str | None = None  # serving dtype; default: the base's
    batch: int = 1000  # adapters per LMDB txn
    progress: bool = True
    initial_map_size: int = 256 * MiB
    store: str | None = None  # s3://bucket/prefix: each worker publishes its batches (store_materialize)
    store_only: bool = False  # with `store`: build into the store alone, nothing kept locally (store_materialize)

    def __post_init__(self) -> None:
        self.catalog_dir, self.model_dir = Path(self.catalog_dir), Path(self.model_dir)
        if self.count < 0 or self.rank < 1 or self.workers < 1 or self.batch < 1:
            raise ValueError("need count >= 0, rank >= 1, workers >= 1, batch >= 1")
        if self.store_only and not self.store:
            raise ValueError("store_only needs a store")
        if isinstance(self.targets, str):
            self.targets = parse_targets(self.targets)
        parse_targets(",".join(self.targets))
        if self.dtype is not None and self.dtype not in SERVING_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        validate_adapter_id(adapter_id(self.prefix, max(self.count - 1, 0), self.width))

    @property
    def width(self) -> int:
        return max(7, len(str(max(self.count - 1, 0))))


@dataclass(slots=True)
class MaterializeReport:
    """Outcome of a run: adapters written now, already present (skipped), build errors."""

    written: int
    skipped: int
    errors: list[str]
    seconds: float
    failed_workers: int = 0
    published: int = 0  # with a store: adapters whose policy this run wrote there
    already: int = 0  # with a store: adapters it found there already

    @property
    def ok(self) -> bool:
        return not self.errors and self.failed_workers == 0


def _jobs(cfg: MaterializeConfig, num_shards: int, base: BaseInfo) -> list[WorkerJob]:
    dtype = cfg.dtype or base.dtype
    modules = target_modules(base.modules, cfg.targets)
    template = build_template(modules, cfg.rank, cfg.targets, dtype, base.fingerprint)
    workers = min(cfg.workers, num_shards)
    return [
        WorkerJob(cfg.catalog_dir, num_shards, list(range(w, num_shards, workers)), cfg.count, cfg.prefix,
                  cfg.width, cfg.seed, cfg.rank, cfg.targets, base.fingerprint, template, cfg.batch,
                  cfg.initial_map_size, cfg.store, cfg.store_only)
        for w in range(workers)
    ]


def materialize(cfg: MaterializeConfig, base: BaseInfo | None = None) -> MaterializeReport:
    """Run the workers with a progress bar; returns the report (check `.ok`)."""
    start = time.perf_counter()
    base = base or BaseInfo.from_dir(cfg.model_dir)
    with Catalog.open(cfg.catalog_dir) as catalog:
        num_shards = catalog.shards
    jobs = _jobs(cfg, num_shards, base)
    # fork: workers need no re-import of the caller's modules; they only use numpy/lmdb, and
    # the parent holds no LMDB env or lock at this point (the catalog above is closed)
    ctx = mp.get_context("fork")
    progress, results = ctx.Value("q", 0), ctx.Queue()
    # workers die with this process (even under kill -9), so none writes on as an orphan
    procs = [ctx.Process(target=run_worker, args=(job, progress, results, os.getpid()), daemon=True)
             for job in jobs]
    for p in procs:
        p.start()
    summaries = _watch(procs, progress, results, cfg)
    written = sum(s[1] for s in summaries)
    skipped = sum(s[2] for s in summaries)
    errors = [e for s in summaries for e in s[3]]
    failed = sum(1 for s in summaries if s[0] != "ok") + (len(procs) - len(summaries))
    return MaterializeReport(written, skipped, errors, time.perf_counter() - start, failed,
                             sum(s[4] for s in summaries), sum(s[5] for s in summaries))


def _watch(procs, progress, results, cfg: MaterializeConfig) -> list[tuple]:
    summaries = []
    with tqdm(total=cfg.count, unit="adapter", disable=not cfg.progress, smoothing=0.1) as bar:
        while len(summaries) < len(procs):
            try:
                summaries.append(results.get(timeout=0.2))
            except Exception:  # queue.Empty: no worker done yet
                if not any(p.is_alive() for p in procs) and results.empty():
                    break  # a worker died without a summary (killed); counted as failed
            bar.update(progress.value - bar.n)
        bar.update(progress.value - bar.n)
    for p in procs:
        p.join()
    return summaries
