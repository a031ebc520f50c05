"""Tombstones: which revision ids of an adapter were deleted, and when.

Engines cache adapter weights by `(adapter_id, revision)` (revisions are immutable), so a
deleted revision's id must never name other bytes: a tombstone keeps it taken. It is also how
`catalog gc` knows when a revision was deleted (its blob outlives the records for a grace
period, so a request that resolved it just before the delete still reads it).

Storage: the adapter's shard's `meta` db, key `deleted:` + adapter id, value a JSON object
`{revision: unix time of the delete}`; kept for good (a few bytes per deleted revision), and
copied to host copies by `catalog.sync` with the rest of the `meta` db.
"""
from __future__ import annotations

import json

import lmdb

from .shards import Dbs

PREFIX = b"deleted:"


def _key(adapter_id: str) -> bytes:
    return PREFIX + adapter_id.encode()


def read_tombstones(txn: lmdb.Transaction, dbs: Dbs, adapter_id: str) -> dict[str, float]:
    """`{revision: deleted at}` of the adapter's deleted revisions (empty: none)."""
    raw = txn.get(_key(adapter_id), db=dbs.meta)
    return {} if raw is None else json.loads(bytes(raw))


def add_tombstones(txn: lmdb.Transaction, dbs: Dbs, adapter_id: str, revisions: list[str],
                   now: float) -> None:
    """Record `revisions` of `adapter_id` as deleted at `now` (inside a write txn)."""
    dead = read_tombstones(txn, dbs, adapter_id)
    dead.update(dict.fromkeys(revisions, now))
    txn.put(_key(adapter_id), json.dumps(dead, separators=(",", ":"), sort_keys=True).encode(),
            db=dbs.meta)
