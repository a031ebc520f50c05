"""The materialize worker: builds and stores the synthetic adapters of the shards it owns.

Runs in its own process (torch-free). Per shard it reads which ids already exist, then writes
the missing ones in batches, one LMDB txn per batch; each adapter's policy record, revision
record and blob go in the same txn, so a kill leaves only whole adapters and a rerun skips them.
A worker dies with its parent (`exit_with_parent`): a killed `materialize` leaves no orphan
writing on.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .format import blob_checksum
from .records import PolicyRecord, RevisionRecord
from .shards import Shard, ShardOptions, add_blob_bytes
from .synth import BlobTemplate

REVISION = "r1"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_PERIOD_S = 0.5


@dataclass(slots=True)
class WorkerJob:
    """What one worker builds: the adapters of `shards` among ids `prefix{0..count-1}`."""

    catalog_dir: Path
    num_shards: int
    shards: list[int]
    count: int
    prefix: str
    width: int  # zero-padded digits of the index in an id
    seed: int
    rank: int
    targets: list[str]
    fingerprint: str
    template: BlobTemplate
    batch: int
    initial_map_size: int
    store: str | None = None  # s3://bucket/prefix: publish each committed batch there (store_materialize)
    store_only: bool = False  # build into `store` alone, nothing into the local shards (store_materialize)


def adapter_id(prefix: str, index: int, width: int) -> str:
    return f"{prefix}{index:0{width}d}"


def ids_by_shard(job: WorkerJob) -> dict[int, list[str]]:
    """This worker's ids grouped by shard, sorted (sorted keys make LMDB inserts cheap)."""
    own = {s: [] for s in job.shards}
    for i in range(job.count):
        aid = adapter_id(job.prefix, i, job.width)
        s = xxhash.xxh3_64_intdigest(aid.encode()) % job.num_shards
        if s in own:
            own[s].append(aid)
    return own


def existing_ids(shard: Shard, prefix: str) -> set[str]:
    def scan(txn, dbs):
        cur, found, key = txn.cursor(db=dbs.policy), set(), prefix.encode()
        if cur.set_range(key):
            for k in cur.iternext(keys=True, values=False):
                k = bytes(k)
                if not k.startswith(key):
                    break
                found.add(k.decode())
        return found

    return shard.read(scan, default=set())


_ID, _SUM = "synth/ID-PLACEHOLDER", "CHECKSUM-PLACEHOLDER"


def record_templates(job: WorkerJob, size: int, now: float) -> tuple[bytes, bytes]:
    """(policy JSON, revision JSON) of a synthetic adapter with placeholder id and checksum.

    All synthetic revisions of a batch share every other field, so filling two placeholders
    gives exactly the bytes `to_json` would (ids and hex digests need no JSON escaping).
    """
    rec = RevisionRecord(_ID, REVISION, size, _SUM, now, job.fingerprint, job.rank, job.targets,
                         job.template.dtype, "synthetic")
    pol = PolicyRecord(_ID, job.fingerprint, job.rank, job.targets, [REVISION], REVISION, created=now, updated=now)
    return pol.to_json(), rec.to_json()


def _put_sorted(txn, db, items: list[tuple[bytes, bytes]]) -> None:
    """Insert key-sorted items; append mode (full pages, no key compares) when they all sort after the db's last key."""
    if not items:
        return
    cur = txn.cursor(db=db)
    append = not cur.last() or bytes(cur.key()) < items[0][0]
    cur.putmulti(items, append=append)


def build_items(job: WorkerJob, ids: list[str], now: float) -> tuple[list, list, list]:
    """(policies, revisions, blobs) of `ids` as LMDB (key, value) items, in id order; raises on a build error."""
    blobs = job.template.blobs(ids, job.seed)
    pol_t, rev_t = record_templates(job, len(blobs[0]) if blobs else 0, now)
    policies, revisions, blob_items = [], [], []
    for aid, blob in zip(ids, blobs):
        a, key = aid.encode(), f"{aid}@{REVISION}".encode()
        policies.append((a, pol_t.replace(_ID.encode(), a)))
        revisions.append((key, rev_t.replace(_ID.encode(), a).replace(_SUM.encode(), blob_checksum(blob).encode())))
        blob_items.append((key, blob))
    return policies, revisions, blob_items


def _put_batch(job: WorkerJob, ids: list[str], now: float):
    """Txn body for one batch of sorted ids: write each id not yet present. Returns (written,
    skipped, errors, and with `job.store` the written adapters' (policy, [(record, blob)]) to publish)."""

    def body(txn, dbs):
        todo = [a for a in ids if txn.get(a.encode(), db=dbs.policy) is None]
        errors: list[str] = []
        try:
            policies, revisions, blob_items = build_items(job, todo, now)
        except Exception as e:  # a build error is counted and reported, never half-written
            return 0, len(ids) - len(todo), [f"batch {todo[:1]}..: {e}"], []
        _put_sorted(txn, dbs.blob, blob_items)
        _put_sorted(txn, dbs.revision, revisions)
        _put_sorted(txn, dbs.policy, policies)
        add_blob_bytes(txn, dbs, sum(len(b) for _, b in blob_items))
        return len(todo), len(ids) - len(todo), errors, _to_publish(job, policies, revisions, blob_items)

    return body


def _to_publish(job: WorkerJob, policies, revisions, blob_items) -> list:
    if job.store is None:
        return []
    return as_adapters(policies, revisions, blob_items)


def as_adapters(policies, revisions, blob_items) -> list[tuple[PolicyRecord, list[tuple[RevisionRecord, bytes]]]]:
    """`build_items`' output as the (policy, [(record, blob)]) list a segment is published from."""
    return [(PolicyRecord.from_json(p), [(RevisionRecord.from_json(r), b)])
            for (_, p), (_, r), (_, b) in zip(policies, revisions, blob_items)]


def _build_shard(job: WorkerJob, shard: Shard, ids: list[str], progress, publisher=None) -> tuple[int, int, list[str]]:
    """Write the ids of `shard` it lacks, batch by batch; with `publisher` (store_materialize),
    first publish what an earlier run committed but did not publish, then each batch as committed."""
    have = existing_ids(shard, job.prefix)
    if publisher is not None:
        publisher.catch_up(shard, [i for i in ids if i in have], job.batch)
    todo = [i for i in ids if i not in have]
    written, skipped, errors = 0, len(ids) - len(todo), []
    with progress.get_lock():
        progress.value += skipped
    for lo in range(0, len(todo), job.batch):
        batch = todo[lo : lo + job.batch]
        w, sk, err, made = shard.write(_put_batch(job, batch, time.time()))
        written, skipped, errors = written + w, skipped + sk, errors + err
        if publisher is not None:
            publisher.publish(shard.index, made)
        with progress.get_lock():
            progress.value += len(batch)
    return written, skipped, errors


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCHDOG_PERIOD_S)
    os._exit(1)


def exit_with_parent(parent_pid: int) -> None:
    """End this process when `parent_pid` (the process that started it) dies.

    Linux: PR_SET_PDEATHSIG with SIGKILL, safe here because a worker's every write is one LMDB
    txn (a kill loses the batch in flight, never half of one). The signal follows the parent
    *thread* that forked the worker; `materialize` blocks in that thread until its workers end.
    Elsewhere: a daemon thread polls os.getppid(). A parent already gone before either was
    armed is caught by the check after.
    """
    if not _set_parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(1)


def run_worker(job: WorkerJob, progress, results, parent_pid: int | None = None) -> None:
    """Build this worker's shards; add finished counts to `progress` (a shared int), put a summary on `results`.

    With `parent_pid` the worker exits as soon as that process dies (see `exit_with_parent`).
    Commits are not fsynced one by one (a killed process loses nothing: committed pages are in
    the page cache); every shard is fsynced once at the end, so the OS writes back meanwhile.
    """
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    opts = ShardOptions(initial_map_size=job.initial_map_size, sync=False)
    written, skipped, errors, opened = 0, 0, [], []
    publisher = None
    try:
        if job.store is not None:
            from .store_materialize import BatchPublisher
            publisher = BatchPublisher(job.store, job.catalog_dir)
        for s, ids in ids_by_shard(job).items():
            if job.store_only:
                w, sk, err = publisher.build_shard(
                    s, ids, job.batch, lambda b: as_adapters(*build_items(job, b, time.time())), progress)
            else:
                opened.append(Shard(job.catalog_dir, s, opts))
                w, sk, err = _build_shard(job, opened[-1], ids, progress, publisher)
            written, skipped, errors = written + w, skipped + sk, errors + err
        for shard in opened:
            shard.sync()
            shard.close()
        results.put(("ok", written, skipped, errors, *_published(publisher)))
    except Exception as e:  # storage (or store) failure: report it, the parent exits non-zero
        results.put(("failed", written, skipped, errors + [f"{type(e).__name__}: {e}"], *_published(publisher)))
    finally:
        if publisher is not None:
            publisher.close()


def _published(publisher) -> tuple[int, int]:
    return (0, 0) if publisher is None else (publisher.published, publisher.already)
