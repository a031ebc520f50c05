"""Publishing a local catalog write into the durable tier (module store_s3 for the whole tier).

`publish(adapter_id)` makes the store agree with this host's catalog for one adapter: it
uploads the revisions the store lacks, their blobs end to end as one new segment object (a key
never written before), and, when the local promoted revision, tags or deleted revisions differ
from the store's, the merged policy, which carries each new revision's record and place in the
segment (`placed`): the revisions of both less every revision either side deleted (the local
tombstones, `catalog.tombstones`, and the store's `deleted`), promoted, previous and tags as the
local write left them (last writer wins); and, when the store had the adapter already, a
change-log entry (a new adapter needs none: no host holds it yet). The policy goes last, so it
never names an object the store lacks. A whole adapter deleted here leaves the store a policy
with no revisions (so a stale host cannot publish its old revisions back). What a deleted
revision leaves (its segment, or a record and blob from before segments) goes when
`loraserve catalog store-gc` (store_gc) finds no live revision naming it. A publish writes no
object it did not create itself, so it never reuses one the GC may be deleting; the price is no
sharing of equal blobs between revisions published apart. Idempotent: what the store holds as
it is here is skipped after one policy read.
"""
from __future__ import annotations

import functools
import time

from .errors import AdapterNotFound
from .records import PolicyRecord
from .store import Catalog
from .store_log import ChangeLog
from .store_objects import ObjectStore, PolicyDoc
from .tombstones import read_tombstones


class Publisher:
    """Uploads one host's committed writes (module doc)."""

    def __init__(self, store: ObjectStore, catalog: Catalog, changes: ChangeLog) -> None:
        self.store, self.catalog, self.changes = store, catalog, changes

    def publish(self, adapter_id: str) -> bool:
        """Make the store agree with the local catalog on `adapter_id`; whether anything was uploaded."""
        local = self._local(adapter_id)
        doc = self.store.policy_doc(adapter_id)
        remote, remote_dead = doc.policy, doc.deleted
        dead = {**remote_dead, **self._tombstones(adapter_id)}
        if local is None and remote is None:
            return False  # deleted before it was ever published
        known = set(remote.revisions) if remote is not None else set()
        fresh = [rev for rev in (local.revisions if local is not None else ()) if rev not in known and rev not in dead]
        placed = {rev: where for rev, where in doc.placed.items() if rev not in dead}
        placed.update(self.upload(adapter_id, fresh))
        policy = self._merged(adapter_id, local, remote, dead)
        if remote is not None and policy.revisions == remote.revisions and dead.keys() == remote_dead.keys() \
                and (remote.promoted, remote.tags) == (policy.promoted, policy.tags):
            return False
        self.store.put_policy(PolicyDoc(policy, dead, placed))
        gone = [r for r in known if r in dead and r not in doc.placed]  # records from before segments
        if gone:
            self.store.delete([self.store.record_key(adapter_id, r) for r in gone])
        if remote is not None:
            self.changes.append(adapter_id)
        return True

    def upload(self, adapter_id: str, revisions: list[str]) -> dict[str, dict]:
        """`revisions` of `adapter_id` into one new segment; their `placed` entries (none: no request)."""
        if not revisions:
            return {}
        records = [self.catalog.resolve(adapter_id, rev) for rev in revisions]
        entries = self.store.put_segment([(record, self.catalog.read_blob(record)) for record in records])
        return dict(zip(revisions, entries))

    def _local(self, adapter_id: str) -> PolicyRecord | None:
        try:
            return self.catalog.policy(adapter_id)
        except AdapterNotFound:
            return None

    def _tombstones(self, adapter_id: str) -> dict[str, float]:
        shard = self.catalog.shard(self.catalog.shard_index(adapter_id))
        return shard.read(functools.partial(read_tombstones, adapter_id=adapter_id), default={})

    @staticmethod
    def _merged(adapter_id: str, local: PolicyRecord | None, remote: PolicyRecord | None,
                dead: dict[str, float]) -> PolicyRecord:
        """The policy the store gets: both sides' revisions less the dead; the rest as `local`
        has it (as `remote` had it when the adapter was deleted here)."""
        known = set(remote.revisions) if remote is not None else set()
        ours = local.revisions if local is not None else []
        merged = [r for r in [*(remote.revisions if remote else []), *(r for r in ours if r not in known)]
                  if r not in dead]
        if local is None:  # deleted here: no revision left
            return PolicyRecord(adapter_id, remote.base_fingerprint, remote.rank, list(remote.targets), [],
                                None, None, {}, remote.created, time.time())
        keep = set(merged)
        return PolicyRecord(adapter_id, local.base_fingerprint, local.rank, list(local.targets), merged,
                            local.promoted if local.promoted in keep else None,
                            local.previous if local.previous in keep else None,
                            {t: r for t, r in local.tags.items() if r in keep}, local.created, time.time())
