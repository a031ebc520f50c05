"""Transaction bodies of catalog writes: each runs inside one LMDB txn of the adapter's shard.

They compute everything from what the txn reads, so a txn retried after a map grow (or a
rerun after a crash) does the same thing again.
"""
from __future__ import annotations

import re

import lmdb

from .errors import AdapterNotFound, BaseMismatch, CorruptBlob, RevisionExists, RevisionNotFound
from .format import blob_checksum, read_adapter_meta
from .records import PolicyRecord, RevisionRecord
from .shards import Dbs, add_blob_bytes
from .tombstones import read_tombstones

_AUTO_REV = re.compile(r"r(\d+)")


def read_policy(txn: lmdb.Transaction, dbs: Dbs, adapter_id: str) -> PolicyRecord | None:
    raw = txn.get(adapter_id.encode(), db=dbs.policy)
    return PolicyRecord.from_json(raw) if raw is not None else None


def read_revision(txn: lmdb.Transaction, dbs: Dbs, adapter_id: str, revision: str) -> RevisionRecord:
    raw = txn.get(f"{adapter_id}@{revision}".encode(), db=dbs.revision)
    if raw is None:
        raise RevisionNotFound(f"adapter {adapter_id!r} has no revision {revision!r}")
    return RevisionRecord.from_json(raw)


def require_policy(txn: lmdb.Transaction, dbs: Dbs, adapter_id: str) -> PolicyRecord:
    policy = read_policy(txn, dbs, adapter_id)
    if policy is None:
        raise AdapterNotFound(f"adapter {adapter_id!r} not found")
    return policy


def next_revision_id(revisions: list[str]) -> str:
    """`r{n+1}` where n is the highest auto-numbered revision so far (ids are never reused)."""
    numbers = [int(m[1]) for r in revisions if (m := _AUTO_REV.fullmatch(r))]
    return f"r{max(numbers, default=0) + 1}"


def _set_promoted(txn, dbs, policy: PolicyRecord, revision: str, now: float) -> None:
    if policy.promoted != revision:
        policy.previous, policy.promoted = policy.promoted, revision
    record = read_revision(txn, dbs, policy.adapter_id, revision)
    policy.rank, policy.targets = record.rank, list(record.targets)
    policy.updated = now


def save_policy(txn, dbs, policy: PolicyRecord) -> PolicyRecord:
    txn.put(policy.adapter_id.encode(), policy.to_json(), db=dbs.policy)
    return policy


def put_revision_in_txn(txn, dbs: Dbs, adapter_id: str, blob: bytes, revision: str | None,
                        promote: bool, source: str, now: float) -> RevisionRecord:
    """Store blob + revision record and update the policy, all in `txn`."""
    meta = read_adapter_meta(blob, f"blob for {adapter_id}")
    checksum = blob_checksum(blob)
    policy = read_policy(txn, dbs, adapter_id) or PolicyRecord(
        adapter_id, meta["base_fingerprint"], meta["rank"], meta["targets"], created=now, updated=now
    )
    if policy.base_fingerprint != meta["base_fingerprint"]:
        raise BaseMismatch(
            f"adapter {adapter_id!r} is for base {policy.base_fingerprint}, "
            f"new revision is for base {meta['base_fingerprint']}"
        )
    deleted = read_tombstones(txn, dbs, adapter_id)  # ids of deleted revisions stay taken
    rev = revision or next_revision_id([*policy.revisions, *deleted])
    if rev in deleted:
        raise RevisionExists(f"{adapter_id}@{rev} was deleted; a revision id is never reused")
    if rev in policy.revisions:
        existing = read_revision(txn, dbs, adapter_id, rev)
        if existing.checksum != checksum:
            raise RevisionExists(f"{adapter_id}@{rev} already exists with different content (immutable)")
        if promote and policy.promoted != rev:
            _set_promoted(txn, dbs, policy, rev, now)
            save_policy(txn, dbs, policy)
        return existing
    if rev in policy.tags:
        raise RevisionExists(f"{adapter_id}: {rev!r} is a tag name, not usable as a revision id")
    record = RevisionRecord(
        adapter_id, rev, len(blob), checksum, now, meta["base_fingerprint"], meta["rank"],
        meta["targets"], meta["dtype"], source or meta["source"],
    )
    key = record.ref.encode()
    txn.put(key, record.to_json(), db=dbs.revision)
    txn.put(key, blob, db=dbs.blob)
    add_blob_bytes(txn, dbs, len(blob))
    policy.revisions.append(rev)
    policy.updated = now
    if promote:
        _set_promoted(txn, dbs, policy, rev, now)
    elif policy.promoted is None:
        policy.rank, policy.targets = record.rank, list(record.targets)
    save_policy(txn, dbs, policy)
    return record


def rewrite_blob_in_txn(txn, dbs: Dbs, record: RevisionRecord, blob: bytes) -> RevisionRecord:
    """Replace the stored blob of an existing revision with `blob`, which must be its bytes (the
    record's size and checksum): the repair of a blob that failed its checksum here."""
    if len(blob) != record.size or blob_checksum(blob) != record.checksum:
        raise CorruptBlob(f"{record.ref}: the replacement does not match the record; not written")
    read_revision(txn, dbs, record.adapter_id, record.revision)  # the revision exists here
    txn.put(record.ref.encode(), blob, db=dbs.blob)
    return record


def resolve_name(policy: PolicyRecord, name: str) -> str:
    rev = name if name in policy.revisions else policy.tags.get(name)
    if rev is None:
        raise RevisionNotFound(f"adapter {policy.adapter_id!r} has no revision or tag {name!r}")
    return rev


def promote_in_txn(txn, dbs: Dbs, adapter_id: str, revision: str, now: float) -> PolicyRecord:
    policy = require_policy(txn, dbs, adapter_id)
    _set_promoted(txn, dbs, policy, resolve_name(policy, revision), now)
    return save_policy(txn, dbs, policy)


def rollback_in_txn(txn, dbs: Dbs, adapter_id: str, now: float) -> PolicyRecord:
    policy = require_policy(txn, dbs, adapter_id)
    if policy.previous is None:
        raise RevisionNotFound(f"adapter {adapter_id!r} has no previous revision to roll back to")
    _set_promoted(txn, dbs, policy, policy.previous, now)
    return save_policy(txn, dbs, policy)


def tag_in_txn(txn, dbs: Dbs, adapter_id: str, tag: str, revision: str, now: float) -> PolicyRecord:
    policy = require_policy(txn, dbs, adapter_id)
    if tag in policy.revisions:
        raise RevisionExists(f"{adapter_id}: tag {tag!r} would shadow the revision of that name")
    policy.tags[tag] = resolve_name(policy, revision)
    policy.updated = now
    return save_policy(txn, dbs, policy)
