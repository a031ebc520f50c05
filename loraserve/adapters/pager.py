"""The pager: brings adapter revisions from the catalog (disk) into the CPU cache, off the engine thread.

`resolve` turns a model reference into a `RevisionRecord` (quick: one LMDB read). `fetch` returns a
future of the revision's `AdapterWeights`: already done on a CPU-cache hit, otherwise the result of
one load on the thread pool — read the blob (checksum-verified by the catalog), decode it, check its
base fingerprint, put it in the CPU cache. Loads are single-flight: concurrent fetches of one
missing revision share one catalog read and one future, so every one of them (and nobody else) sees
its error; once a load has finished, the next fetch of that key starts afresh (a retry after an
error, a re-read after a CPU-cache eviction). The engine copies finished weights into the device
pool itself (`AdapterPool.load`), between steps.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loraserve.catalog.errors import BaseMismatch, CorruptBlob
from loraserve.catalog.ids import parse_model_ref
from loraserve.catalog.layout import load_revision
from loraserve.catalog.records import RevisionRecord
from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.stats import PagerStats, page_in_histogram
from loraserve.adapters.weights import AdapterKey

__all__ = ["Pager", "check_base", "record_key", "resolve_record"]


def record_key(record: RevisionRecord) -> AdapterKey:
    """The residency key of a revision: `(adapter_id, revision)`."""
    return record.adapter_id, record.revision


class Pager:
    """Catalog -> CPU-cache loader with single-flight (see module doc).

    `stats` snapshots the counters; `page_in_seconds` is the page-in latency histogram
    (prometheus_client, registered nowhere; a collector yields its `collect()`).
    """

    def __init__(self, catalog, cpu_cache: CpuCache, base_fingerprint: str, *, workers: int = 4):
        if workers < 1:
            raise ValueError(f"pager workers must be >= 1, got {workers}")
        if not base_fingerprint:
            raise ValueError("the pager needs the served base's fingerprint")
        self.catalog = catalog
        self.cpu_cache = cpu_cache
        self.base_fingerprint = base_fingerprint
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loraserve-pager")
        self._lock = threading.Lock()
        self._inflight: dict[AdapterKey, Future] = {}
        self._stats = PagerStats()
        self.page_in_seconds = page_in_histogram()
        self._closed = False

    def resolve(self, model_ref: str) -> RevisionRecord:
        """The revision a model reference names (`tenant/name` = promoted, `tenant/name@rev`).

        Raises InvalidAdapterId (400), AdapterNotFound / RevisionNotFound (404) and
        BaseMismatch (409) when the revision was exported for another base.
        """
        return resolve_record(self.catalog, self.base_fingerprint, model_ref)

    def fetch(self, record: RevisionRecord) -> Future:
        """A future of the revision's weights; done at once on a CPU-cache hit (see module doc)."""
        key = record_key(record)
        start = time.perf_counter()
        with self._lock:  # the cache lookup too: a load finishing meanwhile cannot be missed
            if self._closed:
                raise RuntimeError("the pager is closed")
            weights = self.cpu_cache.get(key)
            self._stats.fetches += 1
            if weights is not None:
                self._stats.cpu_hits += 1
                self.page_in_seconds.labels(source="cpu").observe(time.perf_counter() - start)
                done: Future = Future()
                done.set_result(weights)
                return done
            self._stats.cpu_misses += 1
            future = self._inflight.get(key)
            if future is not None:
                self._stats.singleflight_joins += 1
                return future
            self._stats.disk_reads += 1
            future = self._pool.submit(self._load, record, key)
            self._inflight[key] = future
            return future

    @property
    def stats(self) -> PagerStats:
        """A snapshot of the counters, with the number of loads in flight right now."""
        with self._lock:
            return dataclasses.replace(self._stats, in_flight=len(self._inflight))

    def close(self) -> None:
        """Stop the workers; loads not yet started are cancelled (their futures say so)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Pager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _load(self, record: RevisionRecord, key: AdapterKey):
        """Worker: blob -> weights -> base check -> CPU cache. Runs once per in-flight key."""
        start = time.perf_counter()
        try:
            self._check_base(record.ref, record.base_fingerprint)
            blob = self.catalog.read_blob(record)  # raises CorruptBlob on a checksum mismatch
            weights = load_revision(blob)
            self._check_base(record.ref, weights.base_fingerprint)
            check_finite(record.ref, weights)
            self.cpu_cache.put(key, weights)
        except BaseException:
            with self._lock:
                self._stats.load_errors += 1
            raise
        finally:
            # The key leaves in-flight before the future completes: later fetches hit the cache
            # (success) or start a fresh load (error), never a stale failed future.
            with self._lock:
                self._inflight.pop(key, None)
        self.page_in_seconds.labels(source="disk").observe(time.perf_counter() - start)
        return weights

    def _check_base(self, ref: str, fingerprint: str) -> None:
        check_base(ref, fingerprint, self.base_fingerprint)


def check_finite(ref: str, weights) -> None:
    """CorruptBlob unless every tensor of the revision is finite. Every entry (export, import,
    runtime load) refuses NaN/Inf already; this catches a blob changed behind their back, once
    per page-in, before the weights can reach the CPU cache or the device pool."""
    for name, t in weights.tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CorruptBlob(f"adapter {ref}: tensor {name} holds NaN or Inf; it is not served")


def check_base(ref: str, fingerprint: str, served: str) -> None:
    """BaseMismatch (409) unless revision `ref`, exported for `fingerprint`, fits the served base."""
    if fingerprint != served:
        raise BaseMismatch(f"adapter {ref} was exported for base {fingerprint}, "
                           f"but the served base is {served}")


def resolve_record(catalog, base_fingerprint: str, model_ref: str) -> RevisionRecord:
    """The revision a model reference names, exported for the served base (see Pager.resolve)."""
    adapter_id, revision = parse_model_ref(model_ref)
    record = catalog.resolve(adapter_id, revision)
    check_base(record.ref, record.base_fingerprint, base_fingerprint)
    return record
