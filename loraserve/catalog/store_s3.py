"""The catalog's durable tier: one S3-compatible bucket prefix that every host's catalog caches.

`--catalog-store s3://bucket/prefix` keeps the objects `store_objects` lays out (blobs by
checksum, revision records, policy records, a change log). `StoreTier(store, catalog)` joins one
host's LMDB catalog to it, in four parts:

- publish (`store_publish`): every write this process's catalog commits through its methods
  (put_revision, promote, rollback, tag) calls `published(id)` (`Catalog.observers`), which
  makes the store agree. A failed upload fails the write's call with 503 after the local
  commit; the call is idempotent, and re-running it publishes. A write that names a revision
  the store holds (a training save) is compared by checksum first (`named_revision`). `publish_catalog`
  (catalog.store_bulk) publishes a whole catalog.
- fault in (`store_faultin`): `fault_in(id, rev)` copies a revision the local catalog lacks from
  the store, verified by checksum (a corrupt object is refused and never written).
- follow (`store_log`): `poll()` reads the change log after its cursor and applies each entry to
  an adapter this host holds (faulting in the newly promoted revision when needed, deleting the
  revisions the store deleted: `catalog delete --store` reaches every host so); adapters it
  does not hold are left to fault in when asked for, already at the store's state. `start()`
  polls every `poll_s` on a thread. Bound: a promote is served by every host within `poll_s`
  plus one listing and one blob download of its committing on the writer, given the writers'
  clocks agree within `skew_s`. `store_log.compact` keeps the log small without a host that
  polls across a prune losing an entry.
- bound (`store_bound`): with `max_bytes` (`?cache_mb=N`) least recently used adapters are
  dropped from the local catalog (the store keeps them; a later request faults them in again);
  what the catalog already held when the tier started counts too (`start` seeds it first).

Writes a tier makes while replaying the store (fault-in, poll) are not published again.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

from .deletes import delete
from .errors import AdapterNotFound, CatalogError, RevisionExists
from .format import blob_checksum
from .records import RevisionRecord
from .store import Catalog
from .store_bound import LocalBound
from .store_faultin import FaultIn
from .store_log import ChangeLog
from .store_objects import ObjectStore, PolicyDoc, parse_store_uri
from .store_publish import Publisher

__all__ = ["ObjectStore", "StoreTier", "parse_store_uri"]
log = logging.getLogger("loraserve.catalog.store_s3")
T = TypeVar("T")


class StoreTier:
    """One host's catalog joined to the store (module doc)."""

    def __init__(self, store: ObjectStore, catalog: Catalog, *, poll_s: float = 2.0, skew_s: float = 10.0,
                 max_bytes: int | None = None, blob_grace_s: float = 60.0) -> None:
        self.store, self.catalog, self.poll_s = store, catalog, poll_s
        self.changes = ChangeLog(store, catalog.path / "store-cursor.json", skew_s=skew_s)
        self.publisher = Publisher(store, catalog, self.changes)
        self.copier = FaultIn(store, catalog)
        self.bound = LocalBound(store, catalog, max_bytes, blob_grace_s)
        self._replay = threading.local()
        self._provisional: set[str] = set()  # imported from a source while the store was down
        self._provisional_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        catalog.observers.append(self.published)
        catalog.before_named.append(self.named_revision)

    @property
    def max_bytes(self) -> int | None:
        return self.bound.max_bytes

    @property
    def dropped(self) -> int:
        return self.bound.dropped

    @contextmanager
    def replaying(self):
        """Writes made inside come from the store: `published` skips them."""
        self._replay.on = True
        try:
            yield
        finally:
            self._replay.on = False

    def published(self, adapter_id: str) -> bool:
        """The local catalog committed a write to `adapter_id`: make the store agree
        (store_publish). Whether anything was uploaded."""
        if getattr(self._replay, "on", False):
            return False
        changed = self.publisher.publish(adapter_id)
        if changed:
            self.bound.track(adapter_id)
        return changed

    def named_revision(self, adapter_id: str, revision: str, blob: bytes) -> None:
        """Before a write names its revision (a training save, `s1` or a checkpoint's name) that
        the local catalog lacks: the store is the fleet's copy of every revision it holds, so
        the write must be that revision's bytes. Compared by checksum: equal, the write goes on
        (publishing then uploads nothing); other bytes, or a revision the store deleted, and it
        is refused (RevisionExists, 409) before anything is written, as the local catalog
        refuses a revision id taken by other bytes. One policy read; the store down: its 503."""
        if getattr(self._replay, "on", False) or revision in self._local_revisions(adapter_id):
            return
        doc = self.store.policy_doc(adapter_id)
        if doc.policy is None:
            return
        if revision in doc.deleted:
            raise RevisionExists(f"{adapter_id}@{revision} was deleted in the catalog store; a revision id is "
                                 "never reused: save under another name")
        if revision in doc.policy.revisions:
            record = self.store.locate(doc, revision)[0]
            if record is None or record.checksum != blob_checksum(blob):
                raise RevisionExists(f"{adapter_id}@{revision}: the catalog store holds that revision with "
                                     "other bytes, and the store's copy wins: save under another name")

    def _local_revisions(self, adapter_id: str) -> list[str]:
        try:
            return self.catalog.policy(adapter_id).revisions
        except AdapterNotFound:
            return []

    def fault_in(self, adapter_id: str, revision: str | None = None) -> RevisionRecord:
        """Copy `adapter_id@revision` (default: the promoted one; a tag resolves) from the store
        into the local catalog; AdapterNotFound / RevisionNotFound when the store lacks it."""
        doc, rev = self.copier.remote_revision(adapter_id, revision)
        self.bound.untrack(adapter_id)  # never dropped by a concurrent evict while it comes in
        with self.replaying():
            self.copier.copy(doc, rev)
            self.copier.follow(doc)
        record = self.catalog.resolve(adapter_id, rev)
        self.bound.track(adapter_id)
        self.bound.evict(keep=adapter_id)
        return record

    def provisional(self, adapter_id: str, fetch: Callable[[], T]) -> T:
        """`fetch()` imports `adapter_id` from an adapter source while the store is down (under
        a revision id named after its bytes: sources.content_revision): its write is not
        published now; the first poll that reaches the store settles it (`_settle`)."""
        with self.replaying():
            result = fetch()
        with self._provisional_lock:
            self._provisional.add(adapter_id)
        return result

    def _settle(self) -> None:
        """Settle the provisional imports by the rule that the store is the fleet's copy of
        every adapter it holds (a source only fills ids it lacks): one the store lacks (or
        deleted) is published now; one it holds under the same promoted checksum is its copy
        already; one it holds with other bytes yields (`_yield_to_store`)."""
        with self._provisional_lock:
            pending = sorted(self._provisional)
        for adapter_id in pending:
            doc = self.store.policy_doc(adapter_id)
            if doc.policy is None or not doc.policy.revisions:
                self.published(adapter_id)
            elif not self._same_promoted(doc):
                self._yield_to_store(doc)
            with self._provisional_lock:
                self._provisional.discard(adapter_id)

    def _yield_to_store(self, doc: PolicyDoc) -> None:
        """The store holds the adapter with other bytes than the source gave this host while
        the store was down: this host takes the store's promoted revision (as every other host
        serves it) and drops its provisional one, which, named after its bytes, is never taken
        for one of the store's. Nothing is published."""
        adapter_id = doc.policy.adapter_id
        ours = self.catalog.resolve(adapter_id)
        if doc.policy.promoted is None:
            log.warning("%s: %s holds it with no promoted revision; serving the source's %s",
                        adapter_id, self.store.uri, ours.revision)
            return
        log.warning("%s: the adapter source gave %s (checksum %s) while %s was down, and the store "
                    "holds other bytes; serving the store's %s from now on", adapter_id, ours.revision,
                    ours.checksum, self.store.uri, doc.policy.promoted)
        with self.replaying():
            self.copier.follow(doc)
            if ours.revision not in doc.policy.revisions:
                delete(self.catalog, adapter_id, ours.revision, force=True)
        self.bound.track(adapter_id)

    def _same_promoted(self, doc: PolicyDoc) -> bool:
        promoted = doc.policy.promoted
        record = self.store.locate(doc, promoted)[0] if promoted else None
        return record is not None and record.checksum == self.catalog.resolve(doc.policy.adapter_id).checksum

    def poll(self) -> int:
        """Apply the change-log entries written since the last poll (store_log); how many changed
        an adapter held here (a delete included: store_faultin)."""
        self._settle()
        found = self.changes.changed()
        try:
            applied = sum(self._apply(adapter_id) for adapter_id in
                          (self._held_ids() if found.everything else dict.fromkeys(found.ids)))
        except CatalogError:
            self.changes.unread(found)  # what this poll read is read again by the next one
            raise
        self.changes.save_cursor()
        return applied

    def _apply(self, adapter_id: str) -> int:
        """Make a held adapter the store's (store_faultin.follow); 1 if held."""
        if not self._holds(adapter_id):
            return 0
        doc = self.store.policy_doc(adapter_id)
        if doc.policy is None:
            return 0
        with self.replaying():
            self.copier.follow(doc)
        self.bound.track(adapter_id)
        return 1

    def _held_ids(self) -> list[str]:
        """Every adapter id the local catalog holds (a reconcile after a long absence)."""
        ids: list[str] = []
        while page := self.catalog.list(limit=1000, after=ids[-1] if ids else None):
            ids += [p.adapter_id for p in page]
        return ids

    def _holds(self, adapter_id: str) -> bool:
        try:
            self.catalog.policy(adapter_id)
        except AdapterNotFound:
            return False
        return True

    def touch(self, adapter_id: str) -> None:
        """A request resolved `adapter_id`: the most recently used (store_bound)."""
        self.bound.touch(adapter_id)

    def evict(self, keep: str | None = None) -> int:
        return self.bound.evict(keep)

    def start(self) -> None:
        """Poll every `poll_s` seconds on a daemon thread until `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loraserve-store-poll", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self.bound.max_bytes is not None:
            self.bound.seed()
            self.evict()
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
                self.evict()
            except CatalogError as exc:  # the store is down: resident and cached adapters serve on
                log.warning("catalog store poll failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 30)
        if self.published in self.catalog.observers:
            self.catalog.observers.remove(self.published)
        if self.named_revision in self.catalog.before_named:
            self.catalog.before_named.remove(self.named_revision)
