"""Publishing a local catalog write into the durable tier (module store_s3 for the whole tier).

`publish(adapter_id)` makes the store agree with this host's catalog for one adapter: it
uploads the revisions the store lacks (blob first, then the record: a record never names a blob
the store lacks) and, when the local promoted revision or tags differ from the store's, the
merged policy: the revisions of both, promoted, previous and tags as the local write left them
(last writer wins); and, when the store had the adapter already, a change-log entry (a new
adapter needs none: no host holds it yet). Idempotent: what the store holds as it is here is
skipped after one policy read.
"""
from __future__ import annotations

import time

from .records import PolicyRecord, RevisionRecord
from .store import Catalog
from .store_log import ChangeLog
from .store_objects import ObjectStore


class Publisher:
    """Uploads one host's committed writes (module doc)."""

    def __init__(self, store: ObjectStore, catalog: Catalog, changes: ChangeLog) -> None:
        self.store, self.catalog, self.changes = store, catalog, changes

    def publish(self, adapter_id: str) -> bool:
        """Make the store agree with the local catalog on `adapter_id`; whether anything was uploaded."""
        local = self.catalog.policy(adapter_id)
        remote = self.store.policy(adapter_id)
        known = set(remote.revisions) if remote is not None else set()
        for rev in local.revisions:
            if rev not in known:
                self.publish_revision(self.catalog.resolve(adapter_id, rev))
        if remote is not None and (remote.promoted, remote.tags) == (local.promoted, local.tags) \
                and known.issuperset(local.revisions):
            return False
        merged = [*(remote.revisions if remote else []), *(r for r in local.revisions if r not in known)]
        policy = PolicyRecord(adapter_id, local.base_fingerprint, local.rank, list(local.targets), merged,
                              local.promoted, local.previous, dict(local.tags), local.created, time.time())
        self.store.put(self.store.policy_key(adapter_id), policy.to_json())
        if remote is not None:
            self.changes.append(adapter_id)
        return True

    def publish_revision(self, record: RevisionRecord) -> None:
        blob_key = self.store.blob_key(record.checksum)
        if not self.store.exists(blob_key):
            self.store.put(blob_key, self.catalog.read_blob(record))
        self.store.put(self.store.record_key(record.adapter_id, record.revision), record.to_json())
