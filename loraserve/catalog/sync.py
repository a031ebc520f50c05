"""Keep a host's catalog copy in step with the writer's catalog, shard by shard, while engines
read it.

LMDB must live on a local file system (its lock file and memory map are not coherent over NFS,
SMB, EFS, ...), so every host that runs engine replicas keeps its own copy of the catalog, and
one process writes (the server's ingress, or `loraserve catalog ...`). A copy that engines have
open cannot be replaced file by file: the catalog takes a replaced data file for a fault (the
shard is unavailable until restart). `sync_catalog` writes the differences into the copy
instead, in that shard's write transactions, so engines there see each change atomically in
their next read, without a restart:

- a shard whose source has not committed since the last sync (LMDB's transaction id,
  remembered in the copy's `sync-state.json`) is skipped;
- blobs are immutable per `adapter_id@rev`: only those the copy lacks are read and written
  (batches of at most `batch_bytes`), before any record that names them;
- then, in one transaction, policy and revision records and counters that differ are copied
  and keys the source no longer has are deleted.

Shipping between hosts: sync from a snapshot of the writer's catalog (`snapshot_catalog`:
`mdb_copy` of each changed shard, consistent while the writer runs) copied to the host (rsync,
object storage), never from a network mount. `python -m loraserve.catalog.sync
snapshot|apply SRC DST` runs either step.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from .shardfile import DATA_FILE
from .shards import CATALOG_META, DB_NAMES, shard_dirname
from .store import Catalog, read_catalog_meta

STATE_FILE = "sync-state.json"
SMALL_DBS = ("policy", "revision", "meta")
BATCH_BYTES = 256 << 20


@dataclass(slots=True)
class SyncReport:
    shards_changed: list[int] = field(default_factory=list)
    blobs_copied: int = 0
    bytes_copied: int = 0
    records_written: int = 0
    keys_deleted: int = 0


def _read_state(path: Path) -> dict[str, int]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _txn_id(catalog: Catalog, index: int) -> int | None:
    return catalog.shard(index).read(lambda txn, dbs: txn.id(), default=None)


def _dump(txn, dbs) -> tuple[dict[str, dict[bytes, bytes]], set[bytes]]:
    """The shard's small dbs whole, and its blob keys."""
    small = {name: {bytes(k): bytes(v) for k, v in txn.cursor(db=getattr(dbs, name))}
             for name in SMALL_DBS}
    blobs = {bytes(k) for k in txn.cursor(db=dbs.blob).iternext(keys=True, values=False)}
    return small, blobs


def sync_shard(src: Catalog, dst: Catalog, index: int, report: SyncReport,
               batch_bytes: int = BATCH_BYTES) -> None:
    """Make dst's shard `index` equal src's (see the module docstring for the order)."""
    s_shard, d_shard = src.shard(index), dst.shard(index)
    s_small, s_blobs = s_shard.read(_dump)
    d_small, d_blobs = d_shard.read(_dump, default=({n: {} for n in SMALL_DBS}, set()))
    missing = sorted(s_blobs - d_blobs)
    while missing:
        batch = s_shard.read(lambda txn, dbs: _take(txn, dbs, missing, batch_bytes))
        size = sum(len(v) for _, v in batch)
        d_shard.write(lambda txn, dbs: [txn.put(k, v, db=dbs.blob) for k, v in batch], reserve=size)
        report.blobs_copied += len(batch)
        report.bytes_copied += size
    puts = [(name, k, v) for name in SMALL_DBS for k, v in s_small[name].items()
            if d_small[name].get(k) != v]
    gone = [(name, k) for name in SMALL_DBS for k in d_small[name] if k not in s_small[name]]
    gone += [("blob", k) for k in d_blobs - s_blobs]

    def records(txn, dbs) -> None:
        for name, k, v in puts:
            txn.put(k, v, db=getattr(dbs, name))
        for name, k in gone:
            txn.delete(k, db=getattr(dbs, name))

    if puts or gone:
        d_shard.write(records)
    report.records_written += len(puts)
    report.keys_deleted += len(gone)


def _take(txn, dbs, keys: list[bytes], batch_bytes: int) -> list[tuple[bytes, bytes]]:
    """Pop keys off `keys` and read their blobs, up to batch_bytes (at least one)."""
    out, size = [], 0
    while keys and (not out or size < batch_bytes):
        k = keys.pop(0)
        v = bytes(txn.get(k, db=dbs.blob))
        out.append((k, v))
        size += len(v)
    return out


def sync_catalog(src_dir: str | Path, dst_dir: str | Path) -> SyncReport:
    """Bring the catalog copy at dst_dir (created when missing) up to src_dir's state."""
    dst_dir = Path(dst_dir)
    state_path = dst_dir / STATE_FILE
    report = SyncReport()
    with Catalog.open(src_dir, readonly=True) as src:
        with Catalog.create(dst_dir, shards=src.shards) as dst:
            state = _read_state(state_path)
            for i in range(src.shards):
                txn_id = _txn_id(src, i)
                if txn_id is None or state.get(str(i)) == txn_id:
                    continue
                sync_shard(src, dst, i, report)
                state[str(i)] = txn_id
                report.shards_changed.append(i)
    state_path.write_text(json.dumps(state))
    return report


def snapshot_catalog(src_dir: str | Path, out_dir: str | Path) -> list[int]:
    """Consistent copies (`mdb_copy`, transaction ids kept) of src's shards into out_dir, a
    catalog directory to ship to the hosts and `sync_catalog` from there; a shard whose copy in
    out_dir is already at src's transaction is left alone. Returns the shards copied."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CATALOG_META).write_bytes((src_dir / CATALOG_META).read_bytes())
    copied = []
    for i in range(int(read_catalog_meta(src_dir)["shards"])):
        source, target = src_dir / shard_dirname(i), out_dir / shard_dirname(i)
        if not (source / DATA_FILE).is_file():
            continue
        env = lmdb.open(str(source), readonly=True, max_dbs=len(DB_NAMES))
        try:
            with env.begin() as txn:
                if _file_txn_id(target) == txn.id():
                    continue
            target.mkdir(exist_ok=True)
            for f in target.iterdir():
                f.unlink()
            env.copy(str(target))  # not compact: a compacted copy restarts the txn ids
        finally:
            env.close()
        copied.append(i)
    return copied


def _file_txn_id(shard_dir: Path) -> int | None:
    """The last transaction id of the env in shard_dir; None when there is none."""
    if not (shard_dir / DATA_FILE).is_file():
        return None
    env = lmdb.open(str(shard_dir), readonly=True, max_dbs=len(DB_NAMES), lock=False)
    try:
        with env.begin() as txn:
            return txn.id()
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraserve.catalog.sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["snapshot", "apply"],
                   help="snapshot: consistent copies of SRC's shards into DST (to ship); "
                        "apply: write SRC's differences into the live copy DST")
    p.add_argument("src")
    p.add_argument("dst")
    args = p.parse_args(argv)
    if args.step == "snapshot":
        print(f"shards copied: {snapshot_catalog(args.src, args.dst)}")
    else:
        r = sync_catalog(args.src, args.dst)
        print(f"shards changed: {r.shards_changed}; blobs copied: {r.blobs_copied} "
              f"({r.bytes_copied} bytes); records written: {r.records_written}; "
              f"keys deleted: {r.keys_deleted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
