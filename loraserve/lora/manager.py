"""AdapterManager: the engine's view of adapter residency across the three tiers.

disk (catalog) --pager threads--> CPU cache --engine thread, at admission--> device pool.
It is the scheduler's `AdapterGate`: a sequence is admitted only once its adapter has a pool slot,
and holds a reference on that slot until it finishes or is preempted.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from catalog.errors import BaseMismatch
from catalog.records import RevisionRecord

from ..adapters.pool import AdapterPool, PoolFull
from ..engine.sequence import Sequence

log = logging.getLogger(__name__)
AdapterKey = tuple[str, str]


class AdapterManager:
    def __init__(self, catalog, pool: AdapterPool, cpu_cache, pager, base_fingerprint: str):
        self.catalog = catalog
        self.pool = pool
        self.cpu_cache = cpu_cache
        self.pager = pager
        self.base_fingerprint = base_fingerprint
        self._records: dict[AdapterKey, RevisionRecord] = {}
        self._staged: dict[AdapterKey, object] = {}  # paged in for a parked request, not yet in the pool
        self._lock = threading.Lock()

    # -- request side (any thread) -------------------------------------------------------------
    def resolve(self, ref: str) -> AdapterKey:
        """'tenant/name[@rev]' -> (adapter_id, revision). Raises catalog errors (400/404/409)."""
        rec = self.pager.resolve(ref)
        if rec.base_fingerprint != self.base_fingerprint:
            raise BaseMismatch(f"adapter {rec.adapter_id}@{rec.revision} was exported for base "
                               f"{rec.base_fingerprint}, but this server's base is {self.base_fingerprint}")
        key = (rec.adapter_id, rec.revision)
        with self._lock:
            self._records[key] = rec
        return key

    def is_ready(self, key: AdapterKey) -> bool:
        return key in self.pool or key in self._staged or key in self.cpu_cache

    def fetch(self, key: AdapterKey, done: Callable[[Exception | None], None]) -> None:
        """Page key in to the CPU tier; done(err) runs on a pager thread when it is there."""
        fut: Future = self.pager.fetch(self._records[key])

        def _finish(f: Future) -> None:
            err = f.exception()
            if err is None:
                with self._lock:
                    self._staged[key] = f.result()
            done(err)
        fut.add_done_callback(_finish)

    # -- AdapterGate (engine thread) ------------------------------------------------------------
    def try_acquire(self, seq: Sequence) -> bool:
        key = seq.adapter_key
        if key not in self.pool:
            weights = self._staged.get(key) or self.cpu_cache.get(key)
            if weights is None:  # dropped from the CPU tier before admission: read it again
                weights = self.pager.fetch(self._records[key]).result()
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
        weights = self.pager.fetch(self._records[key]).result()
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

    def close(self) -> None:
        self.pager.close()
