"""The bound of a host's local catalog under the durable tier: least recently used adapters go.

With `max_bytes` (`s3://bucket/prefix?cache_mb=N`), the adapters this tier faulted in or
published are kept in least-recently-used order (a request's resolve: `touch`), and while their
bytes exceed the bound the least recent adapter is dropped from the local catalog (after each
fault-in and each poll; so the bound is exceeded by at most what one poll interval fetches).
Only an adapter the store holds exactly as here (every revision, the promoted one, the tags) is
dropped, with no tombstone: a later request faults it in again. Its records go at once and its
blobs `blob_grace_s` later, so a page-in that resolved it just before still reads its blob.
What is on disk counts: `seed()` (the tier's poll thread, first thing) counts every adapter the
local catalog already holds (a restarted host's cache), as less recent than any this process
has used, oldest policy change first, so eviction picks among them too. An adapter the store
does not hold as it is here (a local-only import) is never dropped, and is no longer counted
once eviction has passed over it.

The drops are module functions of a write transaction (`Shard.write`), so they run where the
shard is mapped (a shard host process, for a serving catalog).
"""
from __future__ import annotations

import functools
import threading
import time

from .errors import AdapterNotFound
from .lru import BoundedLRU
from .records import PolicyRecord, RevisionRecord
from .shards import add_blob_bytes
from .store import Catalog
from .store_objects import ObjectStore
from .writes import read_policy

TRACKED_MAX = 1 << 20  # adapters whose recency a tier keeps (beyond: the least recent untracked)


def drop_records_in_txn(txn, dbs, adapter_id: str) -> list[str]:
    """Remove `adapter_id`'s policy and revision records, with no tombstone (the store keeps
    them); their bytes leave the shard's count now. The refs whose blobs `drop_blobs_in_txn`
    removes later."""
    policy = read_policy(txn, dbs, adapter_id)
    if policy is None:
        return []
    refs, freed = [], 0
    for rev in policy.revisions:
        key = f"{adapter_id}@{rev}".encode()
        raw = txn.get(key, db=dbs.revision)
        if raw is not None:
            freed += RevisionRecord.from_json(raw).size
            txn.delete(key, db=dbs.revision)
            refs.append(key.decode())
    txn.delete(adapter_id.encode(), db=dbs.policy)
    add_blob_bytes(txn, dbs, -freed)
    return refs


def drop_blobs_in_txn(txn, dbs, refs: list[str]) -> int:
    """Delete the blobs of `refs` that no record names again (faulted in since: kept)."""
    dropped = 0
    for ref in refs:
        key = ref.encode()
        if txn.get(key, db=dbs.revision) is None and txn.delete(key, db=dbs.blob):
            dropped += 1
    return dropped


def disk_usage_in_txn(txn, dbs) -> list[tuple[float, str, int]]:
    """(policy updated, adapter id, its blob bytes) of every adapter in the shard."""
    sizes: dict[str, int] = {}
    for key, raw in txn.cursor(db=dbs.revision):
        adapter_id = bytes(key).decode().rpartition("@")[0]
        sizes[adapter_id] = sizes.get(adapter_id, 0) + RevisionRecord.from_json(raw).size
    return [(PolicyRecord.from_json(raw).updated, bytes(key).decode(), sizes.get(bytes(key).decode(), 0))
            for key, raw in txn.cursor(db=dbs.policy)]


class LocalBound:
    """The recency and bytes of the adapters a tier counts, and their eviction (module doc)."""

    def __init__(self, store: ObjectStore, catalog: Catalog, max_bytes: int | None,
                 blob_grace_s: float = 60.0) -> None:
        self.store, self.catalog = store, catalog
        self.max_bytes = max_bytes  # None: no bound
        self.blob_grace_s = blob_grace_s
        self._seen: BoundedLRU[str, int] = BoundedLRU(TRACKED_MAX)  # adapter id -> its local bytes
        self.counted = 0  # bytes of the counted adapters
        self._lock = threading.Lock()
        self._doomed: list[tuple[float, str, list[str]]] = []  # (due, adapter id, refs): blobs to drop
        self.dropped = 0  # adapters dropped from the local catalog

    def seed(self) -> int:
        """Count the adapters already on disk (module doc); how many were added."""
        found = []
        for index in range(self.catalog.shards):
            found += self.catalog.shard(index).read(disk_usage_in_txn, default=[])
        found.sort()
        with self._lock:
            used = dict(self._seen.items())  # more recent than anything on disk from before
            self._seen.clear()
            older = [(adapter_id, size) for _, adapter_id, size in found if adapter_id not in used]
            for adapter_id, size in [*older, *used.items()]:
                self._seen.put(adapter_id, size)
            self.counted = sum(size for _, size in self._seen.items())
        return len(older)

    def touch(self, adapter_id: str) -> None:
        """A request resolved `adapter_id`: the most recently used (when counted)."""
        self._seen.get(adapter_id)

    def untrack(self, adapter_id: str) -> None:
        with self._lock:
            self.counted -= self._seen.pop(adapter_id) or 0

    def track(self, adapter_id: str) -> None:
        """Count `adapter_id`'s local bytes, as the most recently used."""
        try:
            local = self.catalog.policy(adapter_id)
        except AdapterNotFound:  # deleted
            self.untrack(adapter_id)
            return
        size = sum(self.catalog.resolve(adapter_id, rev).size for rev in local.revisions)
        with self._lock:
            self.counted += size - (self._seen.pop(adapter_id) or 0)
            for _, gone in self._seen.put(adapter_id, size):  # past TRACKED_MAX: no longer counted
                self.counted -= gone

    def evict(self, keep: str | None = None) -> int:
        """Drop least recently used adapters until the counted bytes fit `max_bytes`, never
        `keep`; then the blobs whose grace is over. How many adapters were dropped."""
        dropped = 0
        while self.max_bytes is not None and self.counted > self.max_bytes:
            with self._lock:
                oldest = self._seen.pop_oldest()
                if oldest is None:
                    break
                self.counted -= oldest[1]
                if oldest[0] == keep:  # the only one left: the bound cannot be met without it
                    self._seen.put(keep, oldest[1])
                    self.counted += oldest[1]
                    break
            dropped += self._drop(oldest[0])
        self._drop_due_blobs()
        self.dropped += dropped
        return dropped

    def _drop(self, adapter_id: str) -> int:
        """Drop `adapter_id` locally when the store holds it exactly as here; 1 if dropped."""
        try:
            local = self.catalog.policy(adapter_id)
        except AdapterNotFound:
            return 0
        remote = self.store.policy(adapter_id)
        if remote is None or not set(local.revisions) <= set(remote.revisions) or \
                (local.promoted, local.tags) != (remote.promoted, remote.tags):
            return 0  # not (yet) published as it is here: keep it
        shard = self.catalog.shard(self.catalog.shard_index(adapter_id))
        refs = shard.write(functools.partial(drop_records_in_txn, adapter_id=adapter_id))
        with self._lock:
            self._doomed.append((time.monotonic() + self.blob_grace_s, adapter_id, refs))
        return 1

    def _drop_due_blobs(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [d for d in self._doomed if d[0] <= now]
            self._doomed = [d for d in self._doomed if d[0] > now]
        for _, adapter_id, refs in due:
            shard = self.catalog.shard(self.catalog.shard_index(adapter_id))
            shard.write(functools.partial(drop_blobs_in_txn, refs=refs))
