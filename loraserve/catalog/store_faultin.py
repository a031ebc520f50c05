"""Copying from the durable tier into a host's catalog: faulting a revision in, following a policy.

`fault_in(id, rev)` copies a revision the local catalog lacks (the promoted one by default, or
a revision id or tag) from the store: record, then blob verified against the record's xxh3-128
(a corrupt object is refused, CorruptBlob, and never written); the store's promoted revision is
promoted in the same local write when it is the one copied. `follow(doc)` makes a
held adapter's promoted revision and tags the store's (copying the promoted revision in when
needed), then deletes here the revisions the store deleted (`catalog.deletes`, so they leave
tombstones here too); a policy with no revision left deletes the adapter.

The caller runs both inside its `replaying()`, so these writes are not published again.
"""
from __future__ import annotations

from .deletes import delete
from .errors import AdapterNotFound, CorruptBlob, RevisionNotFound
from .store import Catalog
from .store_objects import ObjectStore, PolicyDoc


class FaultIn:
    """Copies revisions and policy state from `store` into `catalog` (module doc)."""

    def __init__(self, store: ObjectStore, catalog: Catalog) -> None:
        self.store, self.catalog = store, catalog

    def remote_revision(self, adapter_id: str, revision: str | None) -> tuple[PolicyDoc, str]:
        """The store's policy object of `adapter_id` and the revision id `revision` names there
        (None: the promoted one; a tag resolves). AdapterNotFound / RevisionNotFound."""
        doc = self.store.policy_doc(adapter_id)
        remote = doc.policy
        if remote is None or not remote.revisions:  # never published, or deleted
            raise AdapterNotFound(f"adapter {adapter_id!r} not found in the catalog store")
        rev = remote.promoted if revision is None else remote.tags.get(revision, revision)
        if rev is None or rev not in remote.revisions:
            raise RevisionNotFound(f"adapter {adapter_id!r} has no revision {revision or 'promoted'!r} "
                                   "in the catalog store")
        return doc, rev

    def copy(self, doc: PolicyDoc, rev: str) -> None:
        """`adapter_id@rev` of the store's `doc` into the local catalog, unless it is held already."""
        remote = doc.policy
        try:
            self.catalog.resolve(remote.adapter_id, rev)
            return  # held already
        except (AdapterNotFound, RevisionNotFound):
            pass
        record, where = self.store.locate(doc, rev)
        if record is None:
            raise CorruptBlob(f"{remote.adapter_id}@{rev}: the store's policy names it, its record is missing")
        blob = self.store.blob(record, where)  # promoted in the same write when the store promotes it
        self.catalog.put_revision(remote.adapter_id, blob, revision=rev, promote=rev == remote.promoted,
                                  source=record.source)

    def follow(self, doc: PolicyDoc) -> None:
        """The store's promoted revision, tags and deletes for a held adapter (module doc)."""
        remote = doc.policy
        if not remote.revisions:
            delete(self.catalog, remote.adapter_id, force=True)
            return
        local = self.catalog.policy(remote.adapter_id)
        if remote.promoted is not None and local.promoted != remote.promoted:
            self.copy(doc, remote.promoted)
            self.catalog.promote(remote.adapter_id, remote.promoted)
        held = set(self.catalog.policy(remote.adapter_id).revisions)
        for tag, rev in remote.tags.items():
            if rev in held and local.tags.get(tag) != rev:
                self.catalog.tag(remote.adapter_id, tag, rev)
        doomed = sorted(rev for rev in held if rev in doc.deleted)
        if doomed and len(doomed) == len(held):
            delete(self.catalog, remote.adapter_id, force=True)
            return
        for rev in doomed:
            delete(self.catalog, remote.adapter_id, rev, force=True)
