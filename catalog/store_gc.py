"""Garbage collection of the durable tier: `loraserve catalog store-gc --store s3://bucket/prefix`.

A delete leaves a policy without the revision, and the publisher deletes the revision's record,
but blobs (content-addressed, possibly shared by several revisions) and segments (many
revisions' blobs end to end: store_bulk) stay. `collect` frees them in two passes:

- mark: every policy object is read, and every revision it still lists is live: a bulk-published
  one keeps its segment (`placed`), any other keeps its record and, through the record's
  checksum, its blob (one GET per such record).
- sweep: then `blobs/`, `segments/` and `revisions/` are listed, and an object no live revision
  names is deleted when it was last written before `cutoff` = the GC's start less `min_age_s`.
  A segment is deleted only when no live revision points into it. One that still holds a live
  revision is kept whole, not rewritten; the report counts the bytes of dead revisions left
  in such segments (`dead_in_live_segments`).

Why a publish racing the GC loses nothing (with `min_age_s` above the longest publish and above
`store_publish.REUSE_S`): a publish writes its blob or segment and its record first and the
policy that names them last. A policy the mark read before the publish wrote it names objects
written after the GC started, less one publish's duration: younger than the cutoff, so they
stay. The mark runs before the listing for this reason. The one object a publish does not
write afresh is a blob the store already holds (same bytes, another revision): it reuses it
only when it was written within `REUSE_S`, hence younger than the cutoff too; an older one it
uploads again. Each doomed object's age is read again (HEAD) right before its delete, so an
upload made since the listing keeps it; and a publish that uploaded a blob again checks that it
is still there once its policy names it (store_publish). What is left is a publish doing that
upload, its policy and its check, all between the HEAD and the DELETE of that one blob.

`loraserve catalog store-gc` holds the store's maintenance lease (store_lease) for its run, so
no other GC and no log compaction runs on the store meanwhile.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .store_objects import ObjectStore, PolicyDoc

PAGE = 1000
KINDS = ("segments", "blobs", "revisions")  # the prefixes swept


@dataclass(slots=True)
class Live:
    """What the mark found live: object keys, and each live segment's live bytes."""

    keys: set[str] = field(default_factory=set)
    segments: dict[str, int] = field(default_factory=dict)
    policies: int = 0
    revisions: int = 0


@dataclass(slots=True)
class StoreGCReport:
    policies: int = 0
    live_revisions: int = 0
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes_freed: int = 0
    pending: int = 0  # unreferenced, written after the cutoff: the next GC's
    dead_in_live_segments: int = 0  # bytes of dead revisions inside segments kept for a live one


def chunks(items: Iterable, size: int = PAGE) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def collect(store: ObjectStore, *, min_age_s: float, workers: int = 8, dry_run: bool = False,
            now: float | None = None, lease=None) -> StoreGCReport:
    """Mark, then sweep, the objects of `store` (module doc). `now` stands for the time the GC
    starts (a test's clock); `dry_run` deletes nothing and reports what would go; `lease`
    (store_lease.StoreLease, held for the run) is checked before each delete."""
    cutoff = (time.time() if now is None else now) - min_age_s
    with ThreadPoolExecutor(workers, thread_name_prefix="loraserve-store-gc") as pool:
        live = mark(store, pool)
        report = StoreGCReport(policies=live.policies, live_revisions=live.revisions)
        for kind in KINDS:
            sweep(store, kind, live, cutoff, report, dry_run, lease, pool)
    return report


def mark(store: ObjectStore, pool: ThreadPoolExecutor) -> Live:
    """Every object a live revision names (module doc), a page of policies at a time."""
    live = Live()
    policy_root = store.key("policies") + "/"
    for page in chunks(key for key, _, _ in store.list_objects("policies")):
        ids = [key[len(policy_root):-len(".json")] for key in page]
        for doc in pool.map(store.policy_doc, ids):
            if doc.policy is not None:
                records = _mark_policy(store, doc, live)
                live.keys.update(store.blob_key(r.checksum) for r in pool.map(_record_of(store), records)
                                 if r is not None)
    return live


def _mark_policy(store: ObjectStore, doc: PolicyDoc, live: Live) -> list[tuple[str, str]]:
    """Mark `doc`'s segments and records; the (id, revision) whose record names a blob."""
    live.policies += 1
    adapter_id, records = doc.policy.adapter_id, []
    for rev in doc.policy.revisions:
        live.revisions += 1
        placed = doc.placed.get(rev)
        if placed is not None:
            live.segments[placed["segment"]] = live.segments.get(placed["segment"], 0) + placed["size"]
            live.keys.add(placed["segment"])
        else:
            live.keys.add(store.record_key(adapter_id, rev))
            records.append((adapter_id, rev))
    return records


def _record_of(store: ObjectStore):
    return lambda ref: store.record(*ref)


def sweep(store: ObjectStore, kind: str, live: Live, cutoff: float, report: StoreGCReport,
          dry_run: bool, lease=None, pool: ThreadPoolExecutor | None = None) -> None:
    """Delete the objects under `kind/` that nothing live names and that are older than
    `cutoff`, a listing page at a time."""
    for page in chunks(store.list_objects(kind)):
        doomed = []
        for key, written, size in page:
            if key in live.keys:
                report.dead_in_live_segments += size - live.segments.get(key, size)
            elif written >= cutoff:
                report.pending += 1
            else:
                doomed.append((key, size))
        if not dry_run:  # its age again, right before the delete: an upload since keeps it
            ages = (pool.map if pool is not None else map)(store.modified, [k for k, _ in doomed])
            doomed = [(k, s) for (k, s), m in zip(doomed, ages) if m is not None and m < cutoff]
            if lease is not None:
                lease.check()
            store.delete([k for k, _ in doomed])
        report.deleted[kind] += len(doomed)
        report.bytes_freed += sum(s for _, s in doomed)
