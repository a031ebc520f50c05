"""Garbage collection of the durable tier: `loraserve catalog store-gc --store s3://bucket/prefix`.

A delete leaves a policy without the revision, but the segment holding its blob (one publish's
or bulk part's blobs end to end) stays, and so do a record and a content-addressed blob from
before segments. `collect` frees them in two passes, then rewrites mostly dead segments:

- mark: every policy object is listed, and every revision it still lists is live: one in a
  segment keeps its segment (`placed`), one from before segments keeps its record and, through
  the record's checksum, its blob. Only the policies that are new or changed since the last
  mark are read (store_mark: what each named, kept by its ETag); the rest cost their share of
  a listing.
- sweep: then `blobs/`, `segments/` and `revisions/` are listed, and an object no live revision
  names is deleted when it was last written before `cutoff` = the GC's start less `min_age_s`.
  A segment is deleted only when no live revision points into it, and a segment retired by a
  rewrite only once retired before the cutoff. One that still holds a live revision is kept;
  the report counts the bytes of dead revisions left in such segments
  (`dead_in_live_segments`).
- rewrite (store_compact): an old live segment with less than half its bytes live has them
  copied to a new segment, its policies moved there, and is retired.

Why a publish racing the GC loses nothing, by construction: every object the GC may delete
(a segment, or a blob or record from before segments) is written once, under a key no publish
writes again or reuses (store_objects; store_publish writes each publish's blobs into a new
segment and the records into the policy). So an object's one write time, as listed, is the
one that counts, and the GC's rule (unnamed by every policy the mark read, and written before
`cutoff` = the GC's start less `min_age_s`) never meets a publish's: a publish writes its
segment first and the policy naming it last. If the mark read that policy before the publish
wrote it, the segment was written after the GC started less one publish's duration, so with
`min_age_s` above the longest publish (and the clock skew between the host and the store)
it is younger than the cutoff and stays. The mark runs before the listing for this reason. No
object is read again before its delete, and no conditional delete is needed (S3's If-Match on
a delete compares ETags, which equal bytes written again would share).

`loraserve catalog store-gc` holds the store's maintenance lease (store_lease) for its run, so
no other GC and no log compaction runs on the store meanwhile.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import store_compact, store_mark
from .store_objects import ObjectStore

PAGE = 1000
KINDS = ("segments", "blobs", "revisions")  # the prefixes swept
MIN_AGE_FLOOR_S = 3600.0  # `--min-age` at least this: longer than any publish, plus clock skew


@dataclass(slots=True)
class Live:
    """What the mark found live: object keys, and each live segment's live bytes."""

    keys: set[str] = field(default_factory=set)
    segments: dict[str, int] = field(default_factory=dict)
    members: dict[str, list[str]] = field(default_factory=dict)  # segment -> the adapters live in it
    policies: int = 0
    revisions: int = 0
    retired: dict[str, float] = field(default_factory=dict)  # store_compact: segment -> when retired
    old_live: dict[str, int] = field(default_factory=dict)  # old live segments seen, for store_compact


@dataclass(slots=True)
class StoreGCReport:
    policies: int = 0
    live_revisions: int = 0
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes_freed: int = 0
    pending: int = 0  # unreferenced, written after the cutoff: the next GC's
    dead_in_live_segments: int = 0  # bytes of dead revisions inside segments kept for a live one
    rewritten: int = 0  # mostly dead segments whose live revisions moved to a new one (store_compact)
    rewritten_bytes: int = 0  # the live bytes so copied


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
        live.retired = store_compact.retired(store)
        report = StoreGCReport(policies=live.policies, live_revisions=live.revisions)
        for kind in KINDS:
            sweep(store, kind, live, cutoff, report, dry_run, lease, pool)
        doomed = store_compact.candidates(live.old_live, live.segments)
        if dry_run:
            report.rewritten = len(doomed)
        elif doomed or live.retired:
            _forget_deleted(store, live)
            report.rewritten, report.rewritten_bytes = store_compact.rewrite_all(
                store, doomed, live.members, pool, lease)
    return report


def _forget_deleted(store: ObjectStore, live: Live) -> None:
    """Drop the retired segments this sweep deleted from `gc-retired.json`."""
    kept = {k: t for k, t in live.retired.items() if k in live.keys or store.exists(k)}
    if kept != live.retired:
        store_compact.save_retired(store, kept)


def mark(store: ObjectStore, pool: ThreadPoolExecutor, cached: bool = True) -> Live:
    """Every object a live revision names (module doc), a page of policies at a time. A policy
    whose listed ETag is the one the last mark read names what it named then (`gc-mark.json.gz`,
    store_mark): only new and changed policies are read. `cached=False` reads every one."""
    live, old, new = Live(), store_mark.load(store) if cached else {}, {}
    root = store.key("policies") + "/"
    for page in chunks(store.list_objects("policies", etags=True)):
        todo = [key for key, _, _, etag in page if etag is None or old.get(key, (None,))[0] != etag]
        new.update((key, old[key]) for key, *_ in page if key in old and key not in todo)
        new.update((key, entry) for key, entry in zip(todo, pool.map(lambda k: store_mark.named(store, k), todo))
                   if entry is not None)
        for key, *_ in page:
            if key in new:
                store_mark.apply(live, key[len(root):-len(".json")], new[key])
    store_mark.save(store, new)
    return live


def sweep(store: ObjectStore, kind: str, live: Live, cutoff: float, report: StoreGCReport,
          dry_run: bool, lease=None, pool: ThreadPoolExecutor | None = None) -> None:
    """Delete the objects under `kind/` that nothing live names and that are older than
    `cutoff`, a listing page at a time."""
    for page in chunks(store.list_objects(kind)):
        doomed = []
        for key, written, size in page:
            if key in live.keys:
                report.dead_in_live_segments += size - live.segments.get(key, size)
                if key in live.segments and written < cutoff:
                    live.old_live[key] = size  # store_compact picks those mostly dead
            elif written >= cutoff or live.retired.get(key, float("-inf")) >= cutoff:
                report.pending += 1  # young, or retired by a rewrite since the cutoff (store_compact)
            else:
                doomed.append((key, size))
        if not dry_run:  # written once: its listed age is final (module doc)
            if lease is not None:
                lease.check()
            store.delete([k for k, _ in doomed])
        report.deleted[kind] += len(doomed)
        report.bytes_freed += sum(s for _, s in doomed)
