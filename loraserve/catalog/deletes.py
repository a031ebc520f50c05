"""Deleting adapters and revisions (`loraserve catalog delete`), and reclaiming their space
(`loraserve catalog gc`).

A delete is one write transaction of the adapter's shard: the revision records go (with the
policy record when no revision is left), tags and `previous` that named them are dropped and a
tombstone (module `tombstones`) keeps their ids from ever being reused; the catalog's observers
then see the write (with `--store`, the durable tier publishes it and every host caching the
store drops them at its next poll: store_faultin). Every reader resolves
through the catalog at each request (the resolve cache is keyed by the shard's write
generation), so from the commit on every tier answers 404 for them. The blobs stay until
`gc`, so a request that resolved a revision just before the delete still pages it in.

`collect_garbage` deletes the blobs no revision record names, once their revision was deleted
at least `min_age` seconds ago (a blob without a tombstone, which no catalog write leaves, goes
at once), and recounts each shard's blob bytes from its records. LMDB puts the freed pages on
its free list: the next writes reuse them, so the shard's file stops growing (it never shrinks
in place; a compacted copy would restart the transaction ids that `catalog.sync` relies on).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from .errors import CatalogError
from .ids import validate_adapter_id, validate_revision
from .records import PolicyRecord, RevisionRecord
from .shards import Dbs, Shard, add_blob_bytes
from .store import Catalog
from .tombstones import add_tombstones, read_tombstones
from .writes import read_revision, require_policy, resolve_name, save_policy


class RevisionServed(CatalogError):
    """The revision (or an adapter's revision) to delete is the promoted one: pass force."""

    status = 409


@dataclass(slots=True)
class Deleted:
    """What one delete removed: the revisions, their blob bytes (freed by `gc`), and the
    policy left (None: the adapter is gone)."""

    adapter_id: str
    revisions: list[str]
    bytes: int
    policy: PolicyRecord | None


@dataclass(slots=True)
class GcReport:
    blobs_deleted: int = 0
    bytes_freed: int = 0
    blobs_pending: int = 0  # deleted less than min_age ago: the next gc takes them
    shards_changed: list[int] = field(default_factory=list)


def delete(catalog: Catalog, adapter_id: str, revision: str | None = None, *,
           force: bool = False) -> Deleted:
    """Delete `adapter_id@revision` (a revision id or tag), or the whole adapter when revision
    is None. RevisionServed when that removes the promoted revision and not `force` (with
    `force` the adapter is left with nothing promoted: requests without a revision get 404)."""
    validate_adapter_id(adapter_id)
    if revision is not None:
        validate_revision(revision)
    body = functools.partial(_delete_in_txn, adapter_id=adapter_id, revision=revision,
                             force=force, now=time.time())
    done = _shard(catalog, adapter_id).write(body)
    for observe in catalog.observers:  # the durable tier publishes the delete (store_publish)
        observe(adapter_id)
    return done


def _shard(catalog: Catalog, adapter_id: str) -> Shard:
    return catalog.shard(catalog.shard_index(adapter_id))


def _delete_in_txn(txn, dbs: Dbs, adapter_id: str, revision: str | None, force: bool,
                   now: float) -> Deleted:
    policy = require_policy(txn, dbs, adapter_id)
    doomed = list(policy.revisions) if revision is None else [resolve_name(policy, revision)]
    if policy.promoted in doomed and not force:
        what = f"{adapter_id}@{policy.promoted}" if revision is not None else adapter_id
        raise RevisionServed(f"{what} is served ({adapter_id}@{policy.promoted} is promoted): "
                             "promote another revision first, or pass --force")
    records = [read_revision(txn, dbs, adapter_id, rev) for rev in doomed]
    for record in records:
        txn.delete(record.ref.encode(), db=dbs.revision)
    add_tombstones(txn, dbs, adapter_id, doomed, now)
    left = _without(policy, set(doomed), now)
    if left is None:
        txn.delete(adapter_id.encode(), db=dbs.policy)
    else:
        save_policy(txn, dbs, left)
    add_blob_bytes(txn, dbs, -sum(r.size for r in records))
    return Deleted(adapter_id, doomed, sum(r.size for r in records), left)


def _without(policy: PolicyRecord, doomed: set[str], now: float) -> PolicyRecord | None:
    """`policy` less the `doomed` revisions (and the tags and pointers naming them); None when
    no revision is left."""
    policy.revisions = [r for r in policy.revisions if r not in doomed]
    if not policy.revisions:
        return None
    policy.tags = {t: r for t, r in policy.tags.items() if r not in doomed}
    if policy.promoted in doomed:
        policy.promoted = None
    if policy.previous in doomed:
        policy.previous = None
    policy.updated = now
    return policy


# -- gc ---------------------------------------------------------------------------------------

def collect_garbage(catalog: Catalog, min_age: float = 60.0) -> GcReport:
    """Delete every shard's unreferenced blobs (module doc); a shard never written is skipped."""
    if min_age < 0:
        raise CatalogError(f"min_age must be >= 0 seconds, got {min_age}")
    report = GcReport()
    now = time.time()
    for index in range(catalog.shards):
        shard = catalog.shard(index)
        found = shard.read(functools.partial(_unreferenced, now=now, min_age=min_age),
                           default=([], 0))
        due, pending = found
        report.blobs_pending += pending
        if due:
            freed = shard.write(functools.partial(_drop_blobs, keys=[k for k, _ in due]))
            report.blobs_deleted += len(freed)
            report.bytes_freed += sum(size for k, size in due if k in freed)
            report.shards_changed.append(index)
    return report


def _unreferenced(txn, dbs: Dbs, now: float, min_age: float) -> tuple[list[tuple[bytes, int]], int]:
    """([(blob key, size)] due for deletion, how many unreferenced ones are not due yet)."""
    due, pending = [], 0
    deleted: dict[str, dict[str, float]] = {}
    for key, blob in txn.cursor(db=dbs.blob):
        key = bytes(key)
        if txn.get(key, db=dbs.revision) is not None:
            continue
        adapter_id, _, rev = key.decode().rpartition("@")
        if adapter_id not in deleted:
            deleted[adapter_id] = read_tombstones(txn, dbs, adapter_id)
        at = deleted[adapter_id].get(rev)
        if at is None or now - at >= min_age:
            due.append((key, len(blob)))
        else:
            pending += 1
    return due, pending


def _drop_blobs(txn, dbs: Dbs, keys: list[bytes]) -> set[bytes]:
    """Delete the blobs of `keys` still unreferenced (a record may have come back since the
    scan: never for a tombstoned id, but check), then recount the shard's blob bytes from its
    revision records. Returns the keys deleted."""
    gone = set()
    for key in keys:
        if txn.get(key, db=dbs.revision) is None and txn.delete(key, db=dbs.blob):
            gone.add(key)
    total = sum(RevisionRecord.from_json(v).size for _, v in txn.cursor(db=dbs.revision))
    txn.put(b"blob_bytes", str(total).encode(), db=dbs.meta)
    return gone
