"""What the store GC's last mark read: each policy's ETag and the objects it named.

A GC pass that read every policy cost one GET per adapter: about 80 minutes for 1,000,000 on
the bench machine (bench/RESULTS.md, issue 25). A policy object's ETag is the MD5 of its bytes
(a single-part PUT, as every policy is), so a policy listed with the ETag the last mark read
names exactly what it named then. `gc-mark.json.gz` keeps, per policy key, [ETag, revision
count, [[named key, live bytes in it or -1], ...]], written at the end of each mark; the next
mark reads only the policies whose listed ETag differs (new, changed, or missing from it) and
takes the rest from it: a listing request per 1,000 adapters plus one GET per change. What a
revision from before segments names through its record (its blob) is kept too: records are
written once. The cache is a plain object of the store, written by every mark (a `--dry-run`'s
too: it deletes nothing, and the cache only saves reads): a GC that finds none, or an
unreadable one, reads every policy, as before.
"""
from __future__ import annotations

import gzip
import json

from .store_objects import ObjectStore, parse_policy

CACHE = "gc-mark.json.gz"


def load(store: ObjectStore) -> dict[str, list]:
    raw = store.get(store.key(CACHE))
    try:
        return {} if raw is None else json.loads(gzip.decompress(raw))
    except (OSError, ValueError):
        return {}  # unreadable: every policy is read again


def save(store: ObjectStore, entries: dict[str, list]) -> None:
    store.put(store.key(CACHE), gzip.compress(json.dumps(entries, separators=(",", ":")).encode(), 6))


def named(store: ObjectStore, policy_key: str) -> list | None:
    """[ETag, revisions, [[key, live bytes or -1], ...]] of the policy at `policy_key` as read
    now; None when it is gone."""
    got = store.get_with_etag(policy_key)
    if got is None:
        return None
    doc = parse_policy(got[0])
    names = []
    for rev in doc.policy.revisions:
        placed = doc.placed.get(rev)
        if placed is not None:
            names.append([placed["segment"], placed["size"]])
            continue
        names.append([store.record_key(doc.policy.adapter_id, rev), -1])
        record = store.record(doc.policy.adapter_id, rev)
        if record is not None:
            names.append([store.blob_key(record.checksum), -1])
    return [got[1], len(doc.policy.revisions), names]


def apply(live, adapter_id: str, entry: list) -> None:
    """Mark what one policy names in `live` (store_gc.Live)."""
    live.policies += 1
    live.revisions += entry[1]
    for key, size in entry[2]:
        live.keys.add(key)
        if size >= 0:
            live.segments[key] = live.segments.get(key, 0) + size
            live.members.setdefault(key, []).append(adapter_id)
