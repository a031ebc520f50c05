"""Rewriting mostly dead segments (`catalog store-gc`, after its sweep): the live revisions move
to a new segment, and the old one is retired, to be deleted by a later GC.

A segment is written whole by one publish or bulk part (store_objects), and the GC deletes it
only when no live revision points into it (store_gc). Deleting most of the adapters of a
bulk-published segment would therefore keep all its bytes for the few live ones. When the live
bytes of a segment written before the GC's cutoff are under `REWRITE_BELOW` of its size (less
than half live), `rewrite` copies them into a new segment and points their policies there:

- Each live revision's blob is read by range, checked by checksum, and the new segment is
  written first, under a fresh key. Then each policy is read again and rewritten with a
  conditional PUT (If-Match on the ETag just read), moving only the revisions that still point
  into the old segment. A policy that a publish changed meanwhile fails its condition and keeps
  the old segment, which the next GC's mark then finds live.
- A publish that read a policy before the rewrite and writes it afterwards carries the old
  `placed` back. The old segment is then live again, and the new segment unreferenced. A GC
  deletes only what no policy names, so nothing is lost; the rewrite is undone, and the next
  GC tries again.
- A reader that read a policy before the rewrite and reads the old segment after it still
  finds it. The old segment is recorded in `gc-retired.json` with the rewrite's time, and a
  sweep deletes a retired segment only when it was retired before its cutoff (the GC's start
  less `min_age_s`), not by the segment's own, older, write time. A reader therefore has
  `min_age_s` between its policy read and its segment read.

`gc-retired.json` is written only under the store's maintenance lease (one GC at a time).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from .errors import CatalogError
from .store_objects import ObjectStore, PolicyDoc, WriteConflict, parse_policy, policy_bytes

REWRITE_BELOW = 0.5  # a segment whose live bytes are under this share of its size is rewritten
RETIRED = "gc-retired.json"


def retired(store: ObjectStore) -> dict[str, float]:
    """{segment key: when it was retired (unix time)} of the segments rewritten and not yet deleted."""
    return store.get_json(store.key(RETIRED)) or {}


def save_retired(store: ObjectStore, entries: dict[str, float]) -> None:
    store.put_json(store.key(RETIRED), entries)


def rewrite(store: ObjectStore, segment: str, adapter_ids: list[str], pool: ThreadPoolExecutor) -> tuple[int, int]:
    """Move the live revisions of `segment` (those of `adapter_ids` that point into it) to a new
    segment (module doc); (adapters moved, bytes copied). Nothing moved when none is left."""
    docs = list(pool.map(lambda a: _read(store, a), dict.fromkeys(adapter_ids)))
    moving = [(doc, etag, rev) for doc, etag in docs if doc.policy is not None
              for rev, where in doc.placed.items() if where["segment"] == segment and rev in doc.policy.revisions]
    if not moving:
        return 0, 0
    pairs = list(pool.map(lambda m: _checked(store, m[0], m[2]), moving))
    entries = store.put_segment(pairs)
    by_doc: dict[str, list] = {}
    for (doc, etag, rev), entry in zip(moving, entries):
        by_doc.setdefault(doc.policy.adapter_id, [doc, etag, {}])[2][rev] = entry
    moved = sum(pool.map(lambda item: _repoint(store, *item), by_doc.values()))
    return moved, sum(len(blob) for _, blob in pairs)


def _read(store: ObjectStore, adapter_id: str) -> tuple[PolicyDoc, str | None]:
    got = store.get_with_etag(store.policy_key(adapter_id))
    if got is None:
        return PolicyDoc(None), None
    return parse_policy(got[0]), got[1]


def _checked(store: ObjectStore, doc: PolicyDoc, rev: str):
    record, where = store.locate(doc, rev)
    return record, store.blob(record, where)  # CorruptBlob: the rewrite stops, nothing repointed


def _repoint(store: ObjectStore, doc: PolicyDoc, etag: str, placed: dict[str, dict]) -> bool:
    """The policy with `placed` moved, if nobody wrote it since it was read; whether it was."""
    doc.placed.update(placed)
    try:
        store.put_if(store.policy_key(doc.policy.adapter_id), policy_bytes(doc), etag)
    except WriteConflict:
        return False
    return True


def candidates(sizes: dict[str, int], live_bytes: dict[str, int]) -> list[str]:
    """The live segments (of `sizes`: listed, old enough) whose live bytes are under REWRITE_BELOW."""
    return [key for key, size in sizes.items() if key in live_bytes and live_bytes[key] < REWRITE_BELOW * size]


def rewrite_all(store: ObjectStore, segments: list[str], members: dict[str, list[str]], pool: ThreadPoolExecutor,
                lease=None) -> tuple[int, int]:
    """Rewrite each of `segments` and retire it; (segments rewritten, bytes copied)."""
    done, copied, entries = 0, 0, retired(store)
    for segment in segments:
        if lease is not None:
            lease.check()
        try:
            moved, size = rewrite(store, segment, members.get(segment, []), pool)
        except CatalogError:
            continue  # a corrupt or unreadable blob: the segment stays as it is
        if moved:
            entries[segment] = time.time()
            save_retired(store, entries)
            done, copied = done + 1, copied + size
    return done, copied
