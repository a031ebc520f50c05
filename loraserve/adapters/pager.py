"""The pager: brings adapter revisions from the catalog (disk) into the CPU cache, off the engine thread.

`resolve` turns a model reference into a `RevisionRecord` (quick: one LMDB read). `fetch` returns a
future of the revision's `AdapterWeights`: already done on a CPU-cache hit, otherwise the result of
one load by a worker thread — read the blob (checksum-verified by the catalog), decode it, check its
base fingerprint and that it is finite, put it in the CPU cache. Loads are single-flight: concurrent
fetches of one missing revision share one catalog read and one future, so every one of them (and
nobody else) sees its error; once a load has finished, the next fetch of that key starts afresh (a
retry after an error, a re-read after a CPU-cache eviction). The engine copies finished weights into
the device pool itself (`AdapterPool.load`), between steps.

Loads are batched. `fetch` only queues a miss (it never waits on the catalog); each worker takes
up to `batch` queued loads at a time and reads their blobs with one `Catalog.read_blobs` call, one
LMDB read transaction per shard, and decodes each blob into tensors that share its one copy out of
the map. At namespace scale (most requests name a cold revision) this pays the per-read costs —
thread hand-off, shard health check, transaction — once per batch instead of once per revision. A
batch forms only from what is already queued: no load waits for others to arrive. Each revision's
checks are its own: a blob that is missing, fails its checksum, was exported for another base or
holds NaN fails that revision's future only, and the rest of the batch is cached as usual.

Where the decode runs. By default a worker decodes what it read. An engine instead calls
`decode_on_owner(wake)`: workers then only read (the part that waits on the disk) and queue the
blobs, `wake()` tells the owner, and the owner's thread decodes them in `finish_reads()` between
its steps. The decode is Python, and Python on a second thread of a busy process is paid several
times: every time the engine thread's torch ops let go of the GIL, the worker takes it and the
engine thread waits for it back. Measured on the cold sweep, the engine process spent about 20%
more CPU per request with the decode on a worker (bench/RESULTS.md).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from loraserve.catalog.errors import BaseMismatch, CorruptBlob
from loraserve.catalog.ids import parse_model_ref
from loraserve.catalog.layout import checked_region, load_revision
from loraserve.catalog.records import RevisionRecord
from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.limits import check_base
from loraserve.adapters.stats import PagerStats, page_in_histogram
from loraserve.adapters.weights import AdapterKey

__all__ = ["Pager", "record_key", "resolve_record"]


def record_key(record: RevisionRecord) -> AdapterKey:
    """The residency key of a revision: `(adapter_id, revision)`."""
    return record.adapter_id, record.revision


@dataclasses.dataclass(slots=True)
class _Load:
    """One queued disk load: a revision and the future every fetch of it shares."""

    record: RevisionRecord
    key: AdapterKey
    future: Future


class Pager:
    """Catalog -> CPU-cache loader with single-flight and batched reads (see module doc).

    Up to `workers` drain tasks run on a thread pool, each loading up to `batch` queued
    revisions at a time until the queue is empty; `batch=1` reads one revision per catalog call.
    (The pool's idle threads hold no reference to the pager, so a pager nobody closed is still
    collected, and its catalog with it.) `stats` snapshots the counters;
    `page_in_seconds` is the page-in latency histogram (prometheus_client, registered nowhere; a
    collector yields its `collect()`): for a disk load, the time from its batch's start until its
    own weights are cached, so a revision late in a batch also counts the ones decoded before it.
    """

    def __init__(self, catalog, cpu_cache: CpuCache, base_fingerprint: str, *, workers: int = 4,
                 batch: int = 16, compute_dtype: str | None = None, healer=None):
        if workers < 1:
            raise ValueError(f"pager workers must be >= 1, got {workers}")
        if batch < 1:
            raise ValueError(f"pager batch must be >= 1, got {batch}")
        if not base_fingerprint:
            raise ValueError("the pager needs the served base's fingerprint")
        self.catalog = catalog
        self.cpu_cache = cpu_cache
        self.base_fingerprint = base_fingerprint
        self.compute_dtype = compute_dtype  # the engine's dtype: factors must not overflow it either
        self.healer = healer  # set (--catalog-store): a blob failing its checksum is healed from the store
        self.workers = workers
        self.batch = batch
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loraserve-pager")
        self._lock = threading.Lock()
        self._queue: deque[_Load] = deque()  # loads no drain task has taken yet, oldest first
        self._draining = 0  # drain tasks submitted and not finished
        self._drained = threading.Condition(self._lock)  # notified when `_draining` drops to 0
        self._inflight: dict[AdapterKey, Future] = {}  # queued or loading, by key
        self._owner_wake: Callable[[], None] | None = None  # set: the owner decodes (finish_reads)
        self._read: deque[tuple[float, list[tuple[_Load, bytearray | Exception]]]] = deque()
        # set: checked weights are copied into CPU-tier slabs in the pool's layout (`slabs`)
        self.slabs = None
        self._stats = PagerStats()
        self.page_in_seconds = page_in_histogram()
        # its two series, looked up once (a `labels()` lookup takes a lock and builds a key)
        self._page_in_cpu = self.page_in_seconds.labels(source="cpu")
        self._page_in_disk = self.page_in_seconds.labels(source="disk")
        self._closed = False

    def resolve(self, model_ref: str) -> RevisionRecord:
        """The revision a model reference names (`tenant/name` = promoted, `tenant/name@rev`).

        Raises InvalidAdapterId (400), AdapterNotFound / RevisionNotFound (404) and
        BaseMismatch (409) when the revision was exported for another base.
        """
        return resolve_record(self.catalog, self.base_fingerprint, model_ref)

    def fetch(self, record: RevisionRecord) -> Future:
        """A future of the revision's weights; done at once on a CPU-cache hit, else a queued
        load (see module doc). Never blocks on the catalog."""
        key = record_key(record)
        start = time.perf_counter()
        with self._lock:  # the cache lookup too: a load finishing meanwhile cannot be missed
            if self._closed:
                raise RuntimeError("the pager is closed")
            weights = self.cpu_cache.get(key)
            self._stats.fetches += 1
            if weights is not None:
                self._stats.cpu_hits += 1
                self._page_in_cpu.observe(time.perf_counter() - start)
                done: Future = Future()
                done.set_result(weights)
                return done
            self._stats.cpu_misses += 1
            future = self._inflight.get(key)
            if future is not None:
                self._stats.singleflight_joins += 1
                return future
            self._stats.disk_reads += 1
            future = Future()
            self._inflight[key] = future
            self._queue.append(_Load(record, key, future))
            if self._draining < self.workers:  # else a running drain task will take it
                self._draining += 1
                self._pool.submit(self._drain)
            return future

    def fetch_carried(self, record: RevisionRecord, blob: bytes) -> Future | None:
        """`fetch` of a revision whose verified blob came with it (read with its record at the
        edge: `IsolatedCatalog.take_carried`): queued for the owner's next `finish_reads`, which
        decodes and checks it as any blob read here, with no catalog read. None when the blob
        is not used: no owner decodes (`decode_on_owner`), it is cached or already being
        loaded, or it is not `record`'s length or base (then `fetch` goes on as it would)."""
        key = record_key(record)
        if self._owner_wake is None or len(blob) != record.size:
            return None
        try:
            self._check_base(record.ref, record.base_fingerprint)
        except BaseMismatch:
            return None
        start = time.perf_counter()
        with self._lock:
            if self._closed or key in self._inflight or key in self.cpu_cache:
                return None
            self._stats.fetches += 1
            self._stats.cpu_misses += 1
            self._stats.blobs_carried += 1
            future: Future = Future()
            future.set_running_or_notify_cancel()
            self._inflight[key] = future
            self._read.append((start, [(_Load(record, key, future), bytearray(blob))]))
        return future

    def count_cpu_hit(self, seconds: float) -> None:
        """Count a revision served from the CPU tier outside `fetch`: the manager loading a
        cached revision into the device pool (`AdapterManager.try_acquire`), which took
        `seconds`. `cpu_hits` is the tier's one hit counter and `page_in_seconds{source="cpu"}`
        times each of them, so every CPU-tier hit lands in both (issue 43: 955 hits, 0 timed)."""
        with self._lock:
            self._stats.cpu_hits += 1
        self._page_in_cpu.observe(seconds)

    @property
    def stats(self) -> PagerStats:
        """A snapshot of the counters, with the number of loads queued or running right now."""
        with self._lock:
            return dataclasses.replace(self._stats, in_flight=len(self._inflight))

    def decode_on_owner(self, wake: Callable[[], None]) -> None:
        """From now on workers only read blobs; `wake()` (called on a worker) says some are read,
        and the owner decodes and caches them by calling `finish_reads()` (see module doc)."""
        self._owner_wake = wake

    def finish_reads(self) -> int:
        """Decode, check and cache the blobs read since the last call, completing their futures
        (their callbacks run here); returns how many loads finished. Any thread may call it
        (each read batch is finished once); with `decode_on_owner` the owner calls it between
        steps, else there is never anything to finish."""
        finished = 0
        while self._read:  # unlocked peek: a step with nothing read takes no lock
            with self._lock:
                if not self._read:
                    return finished
                start, batch = self._read.popleft()
            self._complete(start, batch)
            finished += len(batch)
        return finished

    def wait_reads(self, timeout: float) -> bool:
        """Block up to `timeout` seconds (the GIL released) until every load asked for so far
        has been read, so that `finish_reads` can complete them now; whether they all were.
        The engine thread calls it, briefly, before a step when it has just asked for page-ins,
        so that a read landing within the wait has its request join this step's batch instead
        of the next one's (bench/RESULTS.md, issue 29: cold requests ran in steps of 30-45
        sequences against 46-62 warm, costing 1.3-1.9x the steps per request)."""
        with self._lock:
            return self._drained.wait_for(lambda: self._draining == 0, timeout)

    def wait(self, future: Future):
        """`future.result()` for a fetch of this pager: a caller that would block on it (warm,
        pin) finishes read batches meanwhile, so it also works on the owner's own thread."""
        while self._owner_wake is not None:
            try:
                return future.result(timeout=0.005)
            except FutureTimeout:
                self.finish_reads()
        return future.result()

    def close(self) -> None:
        """Stop the workers once their current batches are done; loads not yet started are
        cancelled (their futures say so, and `concurrent.futures.wait` sees them done); blobs
        read for the owner and not yet decoded are decoded here, so no future is left hanging."""
        with self._lock:
            self._closed = True
            cancelled = list(self._queue)
            self._queue.clear()
            for load in cancelled:
                self._inflight.pop(load.key, None)
        for load in cancelled:
            if load.future.cancel():
                load.future.set_running_or_notify_cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.finish_reads()

    def __enter__(self) -> Pager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drain(self) -> None:
        """Drain task: load up to `batch` queued revisions at a time until none is queued."""
        while True:
            with self._lock:
                if not self._queue:
                    self._draining -= 1
                    if not self._draining:
                        self._drained.notify_all()
                    return
                loads = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
            self._load_batch(loads)

    def _load_batch(self, loads: list[_Load]) -> None:
        """Blobs -> weights -> checks -> CPU cache for one batch (worker thread); with
        `decode_on_owner` the part after the read is queued for `finish_reads`. Every load's
        future completes, with its weights or with its own error, even if the batch as a whole
        breaks."""
        start = time.perf_counter()
        running = []
        for load in loads:
            if load.future.set_running_or_notify_cancel():
                running.append(load)
            else:  # a caller cancelled the shared future: the next fetch starts afresh
                with self._lock:
                    self._inflight.pop(load.key, None)
        try:
            readable = []
            for load in running:  # a record exported for another base is refused unread
                try:
                    self._check_base(load.record.ref, load.record.base_fingerprint)
                    readable.append(load)
                except BaseMismatch as exc:
                    self._finish(load, start, error=exc)
            blobs = self.catalog.read_blobs([load.record for load in readable]) if readable else []
            if self.healer is not None:  # on this pager thread: the store's round trip included
                blobs = [self._healed(load.record, blob) for load, blob in zip(readable, blobs, strict=True)]
            batch = list(zip(readable, blobs, strict=True))
        except Exception as exc:  # read_blobs itself failed (or a bug): the rest fail with it
            for load in [load for load in running if not load.future.done()]:
                self._finish(load, start, error=exc)
            return
        wake = self._owner_wake
        if wake is None:
            self._complete(start, batch)
            return
        with self._lock:
            self._read.append((start, batch))
        wake()

    def _healed(self, record, blob: bytearray | Exception) -> bytearray | Exception:
        """`blob`, or for a CorruptBlob the store's verified copy (catalog.store_heal)."""
        if not isinstance(blob, CorruptBlob):
            return blob
        try:
            healed = self.healer.heal(record, blob)
        except CorruptBlob as exc:
            return exc
        with self._lock:
            self._stats.blobs_healed += 1
        return healed

    def _complete(self, start: float, batch: list[tuple[_Load, bytearray | Exception]]) -> None:
        """Decode, check and cache each read blob of a batch; each load completes on its own."""
        try:
            for load, blob in batch:
                try:
                    if isinstance(blob, Exception):
                        raise blob
                    weights = self._decode(load.record, blob)
                    self.cpu_cache.put(load.key, weights)
                except Exception as exc:
                    self._finish(load, start, error=exc)
                else:
                    self._finish(load, start, weights=weights)
        except Exception as exc:  # a bug outside one load: the rest fail with it
            for load in [load for load, _ in batch if not load.future.done()]:
                self._finish(load, start, error=exc)

    def _decode(self, record: RevisionRecord, blob: bytearray):
        """A verified blob -> weights whose tensors share its memory, checked for this base, for
        finite values and for factors that cannot overflow the engine's dtype (BaseMismatch /
        CorruptBlob / FactorsTooLarge: `catalog.bounds`). Every entry (export, import, runtime
        load) makes the same check; the one here catches a revision stored before it existed or
        changed behind their back, once per page-in, before it can reach the CPU cache or the pool."""
        what = f"adapter {record.ref}"
        if self.slabs is not None:  # the same checks, then one gather into a slab: no views kept
            meta, layout, start = checked_region(blob, what=what, compute_dtype=self.compute_dtype)
            self._check_base(record.ref, meta["base_fingerprint"])
            weights = self.slabs.convert(blob, meta, layout, start)
            if weights is not None:
                return weights
        weights = load_revision(blob, what=what, finite=True, compute_dtype=self.compute_dtype)
        self._check_base(record.ref, weights.base_fingerprint)
        return weights

    def _finish(self, load: _Load, start: float, weights=None, error: BaseException | None = None) -> None:
        """Complete one load. The key leaves in-flight before its future completes: later fetches
        hit the cache (success) or start a fresh load (error), never a stale failed future."""
        with self._lock:
            self._inflight.pop(load.key, None)
            if error is not None:
                self._stats.load_errors += 1
        if error is not None:
            load.future.set_exception(error)
            return
        self._page_in_disk.observe(time.perf_counter() - start)
        load.future.set_result(weights)

    def _check_base(self, ref: str, fingerprint: str) -> None:
        check_base(ref, fingerprint, self.base_fingerprint)


def resolve_record(catalog, base_fingerprint: str, model_ref: str) -> RevisionRecord:
    """The revision a model reference names, exported for the served base (see Pager.resolve)."""
    adapter_id, revision = parse_model_ref(model_ref)
    record = catalog.resolve(adapter_id, revision)
    check_base(record.ref, record.base_fingerprint, base_fingerprint)
    return record
