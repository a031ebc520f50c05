"""AdapterManager: the engine's view of adapter residency across the three tiers.

    disk (catalog) --Pager threads--> CpuCache --engine thread, at admission--> AdapterPool

Ownership (one writer per piece of state):
- `resolve` and `describe` are catalog reads with no state of ours: any thread. (A request's
  model is resolved before it reaches the engine, by `engine.directory.AdapterDirectory`; the
  manager's `resolve` serves `pin` and `warm`.)
- Everything else (`is_ready`, `fetch`, `accept`, the `AdapterGate` methods, `pin`, `unload`,
  `quarantine`) runs on the engine thread only. It is the only writer of the device pool and of
  the staged weights below. The pager's threads only read blobs (`decode_on_engine_thread`): the
  engine thread decodes them in `finish_reads`, and each finished page-in is put on `page_ins`
  (a read batch wakes the engine thread through `notify`, once for all the page-ins that land
  before it looks: `PageIns`), which the engine thread drains, calling `settle`.
- `CpuCache` and `Pager` are self-locking monitors shared with the pager's threads.

It is the scheduler's `AdapterGate`: a sequence is admitted only once its adapter has a pool
slot, and holds a reference on that slot until it finishes or is preempted.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Callable

from loraserve.catalog.records import RevisionRecord

from .pager import resolve_record
from .limits import PoolLimits
from .pool import AdapterPool, PoolFull
from .weights import AdapterKey

log = logging.getLogger(__name__)


MAX_QUARANTINED = 4096


class RevisionQuarantined(RuntimeError):
    """A revision whose numbers went non-finite in this engine: failed, never admitted again."""

    status = 500
    code = "revision_quarantined"
    param = "model"


class AdapterNotServable(ValueError):
    """A revision this server can never load (rank or targets beyond its pool): a 400."""

    status = 400
    code = "invalid_request"
    param = "model"


def resolve_servable(catalog, base_fingerprint: str, limits: PoolLimits, ref: str) -> RevisionRecord:
    """The revision `ref` names, if this server can serve it: catalog errors (400/404/409) or
    AdapterNotServable (400) for a rank or target beyond `limits`."""
    rec = resolve_record(catalog, base_fingerprint, ref)
    try:
        limits.check_admissible(rec.rank, rec.targets)
    except ValueError as exc:  # rank above --max-lora-rank, a target this server does not serve
        raise AdapterNotServable(
            f"adapter {rec.adapter_id}@{rec.revision} cannot be served here: {exc}") from exc
    return rec


def describe_adapter(catalog, adapter_id: str, residency: Callable[[AdapterKey], str]) -> dict:
    """Policy record and revisions of adapter_id, each with `residency(key)` (gpu|cpu|disk)."""
    pol = catalog.policy(adapter_id)
    revisions = []
    for rev in pol.revisions:
        rec = catalog.resolve(adapter_id, rev)
        revisions.append({"revision": rev, "size": rec.size, "checksum": rec.checksum,
                          "created": rec.created, "rank": rec.rank, "targets": rec.targets,
                          "residency": residency((adapter_id, rev))})
    promoted = next((r["residency"] for r in revisions if r["revision"] == pol.promoted), "disk")
    return {"id": adapter_id, "base_fingerprint": pol.base_fingerprint, "rank": pol.rank,
            "targets": pol.targets, "promoted": pol.promoted, "previous": pol.previous,
            "tags": pol.tags, "created": pol.created, "updated": pol.updated,
            "residency": promoted, "revisions": revisions}


class PageIns:
    """Finished page-ins on their way to the engine thread, which is woken once per batch.

    `put` (pager threads) says whether the consumer must be woken: only for the first item
    since the consumer last found the queue empty. Until it does, it is busy draining (or about
    to, woken by that first put), and it takes every later item in the same drain. A batch of
    page-ins (the pager completes up to 16 at once) thus costs one wake-up of the engine thread
    (a pipe write, a poll return) instead of one each. The consumer drains with `get_nowait`
    until queue.Empty, as it does a SimpleQueue.
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._armed = True  # the consumer found the queue empty since the last wake-up

    def put(self, item) -> bool:
        """Queue item; True when the caller must wake the consumer."""
        with self._lock:
            self._items.append(item)
            wake, self._armed = self._armed, False
        return wake

    def get_nowait(self):
        """The oldest item; queue.Empty when there is none (which re-arms the wake-up)."""
        with self._lock:
            if self._items:
                return self._items.popleft()
            self._armed = True
        raise queue.Empty

    def __len__(self) -> int:
        return len(self._items)


class AdapterManager:
    def __init__(self, catalog, pool: AdapterPool, cpu_cache, pager, base_fingerprint: str):
        self.catalog = catalog
        self.pool = pool
        self.cpu_cache = cpu_cache
        self.pager = pager
        self.base_fingerprint = base_fingerprint
        # engine thread only: paged in for a parked request, not yet copied into the pool
        self._staged: dict[AdapterKey, object] = {}
        self.max_staged = 2 * pool.config.max_slots
        self._fetching: dict[AdapterKey, RevisionRecord] = {}  # engine thread only: page-ins asked
        self.page_ins = PageIns()  # (key, weights, error) of finished loads
        self._finishing = False  # the engine thread is in `finish_reads` (it drains `page_ins` next)
        self.notify: Callable[[], None] = lambda: None  # wakes the engine thread (set by its owner)
        # engine thread only: revisions whose numbers went non-finite in a step -> why; never
        # admitted again by this engine (bounded: the oldest are forgotten, and the page-in's
        # factor check refuses most such revisions before they run at all)
        self.quarantined: OrderedDict[AdapterKey, str] = OrderedDict()

    # -- any thread: catalog reads ---------------------------------------------------------------
    def resolve(self, ref: str) -> RevisionRecord:
        """'tenant/name[@rev]' -> the revision a request runs on. Raises catalog errors
        (400/404/409) or AdapterNotServable (400) when this server could never load it."""
        return resolve_servable(self.catalog, self.base_fingerprint, self.pool.limits, ref)

    def describe(self, adapter_id: str, residency: Callable[[AdapterKey], str]) -> dict:
        """Policy record and revisions of adapter_id, each with `residency(key)` (gpu|cpu|disk)."""
        return describe_adapter(self.catalog, adapter_id, residency)

    def warm(self, ref: str) -> AdapterKey:
        """Resolve ref and page it into the CPU tier now (blocking; pager and cache only)."""
        rec = self.resolve(ref)
        self.pager.wait(self.pager.fetch(rec))
        return rec.adapter_id, rec.revision

    def install(self, key: AdapterKey, weights) -> None:
        """Engine thread: serve revision `key` from `weights` already in memory (a training run's
        save, checked servable by its writer), with no catalog read: into the CPU tier, and held
        for admission as a finished page-in is, should the tier not keep it. The catalog write
        of the same revision may still be under way; a page-in after both dropped it reads that."""
        self.cpu_cache.put(key, weights)
        self.settle(key, weights)

    def decode_on_engine_thread(self) -> None:
        """Pager workers only read; the engine thread decodes what they read when it calls
        `finish_reads` between steps (`Pager.decode_on_owner`). A read batch wakes it through
        `notify`, looked up through a weak reference: the pager holding the manager strongly
        would make a cycle, and an engine nobody uses any more would keep its catalog open
        until the garbage collector ran."""
        me = weakref.ref(self)

        def wake() -> None:
            manager = me()
            if manager is not None:
                manager.notify()
        self.pager.decode_on_owner(wake)

    # -- engine thread ---------------------------------------------------------------------------
    def finish_reads(self) -> None:
        """Decode the blobs the pager has read for this thread (`Pager.decode_on_owner`); their
        results land on `page_ins` before this returns, and the engine thread drains them next,
        so they wake nobody (a wake-up would only make the loop run an empty turn)."""
        self._finishing = True
        try:
            self.pager.finish_reads()
        finally:
            self._finishing = False

    def wait_reads(self, timeout: float) -> None:
        """Give the page-ins just asked for up to `timeout` seconds to be read, so that this
        step's `finish_reads` lands them (`Pager.wait_reads`)."""
        self.pager.wait_reads(timeout)

    def is_ready(self, key: AdapterKey) -> bool:
        """Whether key can be admitted without a page-in."""
        return key in self.pool or key in self._staged or key in self.cpu_cache

    def tier_of(self, key: AdapterKey) -> str:
        """The tier a request for key is served from, as it arrives: "device" (in the pool),
        "cpu" (the CPU cache, or staged for admission) or "catalog" (it must be paged in from
        disk). For the request's log line; admission decides nothing by it."""
        if key in self.pool:
            return "device"
        return "cpu" if key in self._staged or key in self.cpu_cache else "catalog"

    def fetch(self, record: RevisionRecord, blob: bytes | None = None) -> bool:
        """Page record in to the CPU tier (once per key until `settle`); `(key, weights, err)`
        arrives on `page_ins` when it is there (at once on a CPU hit). `blob`: its blob, read
        with the record at the edge (`Pager.fetch_carried`). Whether it waits for a catalog read."""
        key = (record.adapter_id, record.revision)
        if key in self._fetching:
            return True
        self._fetching[key] = record
        fut: Future | None = self.pager.fetch_carried(record, blob) if blob is not None else None
        reads = fut is None
        if fut is None:
            fut = self.pager.fetch(record)
        fut.add_done_callback(lambda f: self._done(key, f))
        return reads

    def _done(self, key: AdapterKey, fut: Future) -> None:
        """Pager thread: hand the result over to the engine thread (woken once per batch)."""
        err = fut.exception()
        if self.page_ins.put((key, None if err else fut.result(), err)) and not self._finishing:
            self.notify()

    def settle(self, key: AdapterKey, weights) -> None:
        """A page-in finished (weights None: it failed). Successful weights are held for the
        waiting requests until admission copies them to the pool, so a small CPU cache cannot
        drop them in between. Bounded: oldest first (they are normally still in the CPU cache)."""
        self._fetching.pop(key, None)
        if weights is None:
            return
        self._staged[key] = weights
        while len(self._staged) > self.max_staged:
            self._staged.pop(next(iter(self._staged)))

    def try_acquire(self, key: AdapterKey, record: RevisionRecord | None = None) -> int | None:
        """A slot for key's adapter, loading it from the CPU tier if there is room (the slot now
        holds one more reference); None = not now: the pool is full of in-use adapters, or the
        weights left every tier since they were fetched (then `record` is paged in again)."""
        slot = self.pool.slot_of(key)
        if slot is None:
            start = time.perf_counter()
            weights = self._staged.get(key)  # paged in for this request: counted by its fetch
            from_cpu = weights is None
            weights = weights if weights is not None else self.cpu_cache.get(key)
            if weights is None:
                if record is not None:
                    self.fetch(record)
                return None
            try:
                self.pool.load(key, weights)
            except PoolFull:
                return None  # not served yet: a retry that loads it counts the hit once
            if from_cpu:  # a page-in from the CPU tier: its time is the copy into the pool
                self.pager.count_cpu_hit(time.perf_counter() - start)
            self._staged.pop(key, None)
        return self.pool.acquire(key)

    def is_resident(self, key: AdapterKey) -> bool:
        return key in self.pool

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    def pin(self, ref: str) -> AdapterKey:
        """Load ref now and keep it resident (--pin)."""
        rec = self.resolve(ref)
        key = (rec.adapter_id, rec.revision)
        self.pool.load(key, self.pager.wait(self.pager.fetch(rec)))
        self.pool.pin(key)
        return key

    def unload(self, adapter_id: str) -> int:
        """Drop every revision of adapter_id from the CPU tier and, when unused, the device pool.
        Returns how many device-resident revisions were evicted. An in-use revision stays until
        its sequences finish (then it is an ordinary idle entry, evicted under pressure)."""
        evicted = 0
        for key in [k for k in self.pool.resident() if k[0] == adapter_id]:
            self.pool.unpin(key)
            evicted += bool(self.pool.evict(key))
        for key in [k for k in self.cpu_cache.keys() if k[0] == adapter_id]:
            self.cpu_cache.discard(key)
        for key in [k for k in self._staged if k[0] == adapter_id]:
            del self._staged[key]
        return evicted

    def quarantine(self, key: AdapterKey, why: str) -> None:
        """Never admit revision `key` again: its weights leave the staged set, the CPU tier and,
        once no running sequence holds it, the device pool (an in-use entry is dropped by the
        pool when its last sequence ends; `is_ready` and admission check the quarantine first)."""
        if key in self.quarantined:
            return
        log.error("adapter %s@%s quarantined: %s", key[0], key[1], why)
        self.quarantined[key] = why
        while len(self.quarantined) > MAX_QUARANTINED:
            self.quarantined.popitem(last=False)
        self._staged.pop(key, None)
        self.cpu_cache.discard(key)
        self.pool.unpin(key)
        self.pool.evict(key)

    def check_servable(self, key: AdapterKey) -> None:
        """RevisionQuarantined (500) if key is quarantined."""
        why = self.quarantined.get(key)
        if why is not None:
            raise RevisionQuarantined(f"adapter {key[0]}@{key[1]} is quarantined and not served: {why}")

    def close(self) -> None:
        """Stop the pager, then close the catalog (the manager owns both)."""
        self.pager.close()
        self.catalog.close()
