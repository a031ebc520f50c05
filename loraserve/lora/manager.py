"""AdapterManager: the engine's view of adapter residency across the three tiers.

disk (catalog) --pager threads--> CPU cache --engine thread, at admission--> device pool.
It is the scheduler's `AdapterGate`: a sequence is admitted only once its adapter has a pool slot,
and holds a reference on that slot until it finishes or is preempted.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable


from loraserve.catalog.records import RevisionRecord

from ..adapters.pool import AdapterPool, PoolFull
from ..engine.sequence import Sequence
from ..engine.types import EngineError

log = logging.getLogger(__name__)
AdapterKey = tuple[str, str]


class AdapterManager:
    def __init__(self, catalog, pool: AdapterPool, cpu_cache, pager, base_fingerprint: str):
        self.catalog = catalog
        self.pool = pool
        self.cpu_cache = cpu_cache
        self.pager = pager
        self.base_fingerprint = base_fingerprint
        # records of recently resolved revisions (immutable: an evicted one is read again)
        self._records: OrderedDict[AdapterKey, RevisionRecord] = OrderedDict()
        self.max_records = 64 * pool.config.max_slots
        self._staged: dict[AdapterKey, object] = {}  # paged in for a parked request, not yet in the pool
        self.max_staged = 2 * pool.config.max_slots
        self._lock = threading.Lock()

    # -- request side (any thread) -------------------------------------------------------------
    def resolve(self, ref: str) -> AdapterKey:
        """'tenant/name[@rev]' -> (adapter_id, revision). Raises catalog errors (400/404/409)."""
        rec = self.pager.resolve(ref)  # checks the base fingerprint too (409)
        try:
            self.pool.check_admissible(rec.rank, rec.targets)
        except ValueError as exc:  # rank above --max-lora-rank, a target this server does not serve
            raise EngineError(f"adapter {rec.adapter_id}@{rec.revision} cannot be served here: {exc}",
                              status=400, param="model") from exc
        key = (rec.adapter_id, rec.revision)
        with self._lock:
            self._records[key] = rec
            self._records.move_to_end(key)
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)
        return key

    def record(self, key: AdapterKey) -> RevisionRecord:
        with self._lock:
            rec = self._records.get(key)
        return rec if rec is not None else self.catalog.resolve(*key)

    def is_ready(self, key: AdapterKey) -> bool:
        return key in self.pool or key in self._staged or key in self.cpu_cache

    def fetch(self, key: AdapterKey, done: Callable[[Exception | None], None]) -> None:
        """Page key in to the CPU tier; done(err) runs on a pager thread when it is there."""
        fut: Future = self.pager.fetch(self.record(key))

        def _finish(f: Future) -> None:
            err = f.exception()
            if err is None:
                self._stage(key, f.result())
            done(err)
        fut.add_done_callback(_finish)

    def _stage(self, key: AdapterKey, weights) -> None:
        """Hold paged-in weights for parked requests until admission copies them to the pool, so
        a small CPU cache cannot drop them in between. Bounded: oldest entries go first (they are
        normally still in the CPU cache)."""
        with self._lock:
            self._staged[key] = weights
            while len(self._staged) > self.max_staged:
                self._staged.pop(next(iter(self._staged)))

    # -- AdapterGate (engine thread) ------------------------------------------------------------
    def try_acquire(self, seq: Sequence) -> bool:
        """A slot for seq's adapter, loading it from the CPU tier if there is room; False = not now
        (pool full of in-use adapters, or the weights are being paged in again)."""
        key = seq.adapter_key
        if self.pool.slot_of(key) is None:
            with self._lock:
                weights = self._staged.get(key)
            weights = weights if weights is not None else self.cpu_cache.get(key)
            if weights is None:  # dropped from every tier since it was fetched: page in again
                self.fetch(key, lambda err: None)
                return False
            try:
                self.pool.load(key, weights)
            except PoolFull:
                return False
            with self._lock:
                self._staged.pop(key, None)
        seq.slot = self.pool.acquire(key)
        return True

    def is_resident(self, seq: Sequence) -> bool:
        return seq.adapter_key in self.pool

    def release(self, seq: Sequence) -> None:
        self.pool.release(seq.slot)

    # -- operator side --------------------------------------------------------------------------
    def pin(self, ref: str) -> AdapterKey:
        """Load ref now and keep it resident (--pin)."""
        key = self.resolve(ref)
        weights = self.pager.fetch(self.record(key)).result()
        self.pool.load(key, weights)
        self.pool.pin(key)
        return key

    def residency(self, key: AdapterKey) -> str:
        if key in self.pool:
            return "gpu"
        if key in self.cpu_cache:
            return "cpu"
        return "disk"

    def resident_ids(self) -> list[str]:
        return sorted({aid for aid, _ in self.pool.resident()})

    def describe(self, adapter_id: str) -> dict:
        """Policy record, revisions and where each revision is resident (gpu|cpu|disk)."""
        pol = self.catalog.policy(adapter_id)
        revisions = []
        for rev in pol.revisions:
            rec = self.catalog.resolve(adapter_id, rev)
            revisions.append({"revision": rev, "size": rec.size, "checksum": rec.checksum,
                              "created": rec.created, "rank": rec.rank, "targets": rec.targets,
                              "residency": self.residency((adapter_id, rev))})
        promoted = next((r["residency"] for r in revisions if r["revision"] == pol.promoted), "disk")
        return {"id": adapter_id, "base_fingerprint": pol.base_fingerprint, "rank": pol.rank,
                "targets": pol.targets, "promoted": pol.promoted, "previous": pol.previous,
                "tags": pol.tags, "created": pol.created, "updated": pol.updated,
                "residency": promoted, "revisions": revisions}

    def warm(self, ref: str) -> AdapterKey:
        """Resolve ref and page it into the CPU tier now (blocking)."""
        key = self.resolve(ref)
        self.pager.fetch(self.record(key)).result()
        return key

    def unload(self, adapter_id: str) -> int:
        """Drop every revision of adapter_id from the CPU tier and, when unused, the device pool.
        Returns how many device-resident revisions were evicted."""
        self.catalog.policy(adapter_id)  # AdapterNotFound for an unknown id
        evicted = 0
        for key in [k for k in self.pool.resident() if k[0] == adapter_id]:
            if self.pool.is_pinned(key):
                self.pool.unpin(key)
            evicted += bool(self.pool.evict(key))
        for key in [k for k in self.cpu_cache.keys() if k[0] == adapter_id]:
            self.cpu_cache.discard(key)
        with self._lock:
            for key in [k for k in self._staged if k[0] == adapter_id]:
                del self._staged[key]
        return evicted

    def close(self) -> None:
        self.pager.close()
