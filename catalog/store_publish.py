"""Publishing a local catalog write into the durable tier (module store_s3 for the whole tier).

`publish(adapter_id)` makes the store agree with this host's catalog for one adapter: it
uploads the revisions the store lacks (blob first, then the record: a record never names a blob
the store lacks) and, when the local promoted revision, tags or deleted revisions differ from
the store's, the merged policy: the revisions of both less every revision either side deleted
(the local tombstones, `catalog.tombstones`, and the store's `deleted`), promoted, previous and
tags as the local write left them (last writer wins); and, when the store had the adapter
already, a change-log entry (a new adapter needs none: no host holds it yet). A whole adapter
deleted here leaves the store a policy with no revisions (so a stale host cannot publish its
old revisions back), and the records of deleted revisions go; blobs stay (content-addressed,
possibly shared) until `loraserve catalog store-gc` (store_gc) finds no live revision naming
them. Idempotent: what the store holds as it is here is skipped after one policy
read.
"""
from __future__ import annotations

import functools
import time

from .errors import AdapterNotFound
from .records import PolicyRecord, RevisionRecord
from .store import Catalog
from .store_log import ChangeLog
from .store_objects import ObjectStore, PolicyDoc
from .tombstones import read_tombstones

REUSE_S = 6 * 3600.0  # a stored blob this young is reused by a publish; an older one is uploaded again


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
        refreshed = []
        for rev in local.revisions if local is not None else ():
            if rev not in known and rev not in dead:
                record = self.catalog.resolve(adapter_id, rev)
                if self.publish_revision(record):
                    refreshed.append(record)
        policy = self._merged(adapter_id, local, remote, dead)
        if remote is not None and policy.revisions == remote.revisions and dead.keys() == remote_dead.keys() \
                and (remote.promoted, remote.tags) == (policy.promoted, policy.tags):
            return False
        placed = {rev: where for rev, where in doc.placed.items() if rev not in dead}
        self.store.put_policy(PolicyDoc(policy, dead, placed))
        for record in refreshed:  # a store GC that raced the re-upload: upload it again (store_gc)
            if not self.store.exists(self.store.blob_key(record.checksum)):
                self.store.put(self.store.blob_key(record.checksum), self.catalog.read_blob(record))
        gone = [r for r in known if r in dead]
        if gone:
            self.store.delete([self.store.record_key(adapter_id, r) for r in gone])
        if remote is not None:
            self.changes.append(adapter_id)
        return True

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

    def publish_revision(self, record: RevisionRecord) -> bool:
        """Upload `record`'s blob, unless the store holds it written within `REUSE_S`, then the
        record. A blob written before is uploaded again (its age starts over), so that a store
        GC (store_gc), which deletes only blobs older than its `min_age_s` > `REUSE_S`, never
        takes a blob a publish just reused; whether it was so re-uploaded (`publish` checks it
        is still there once the policy names it)."""
        blob_key = self.store.blob_key(record.checksum)
        written = self.store.modified(blob_key)
        again = written is not None and written < time.time() - REUSE_S
        if written is None or again:
            self.store.put(blob_key, self.catalog.read_blob(record))
        self.store.put(self.store.record_key(record.adapter_id, record.revision), record.to_json())
        return again
