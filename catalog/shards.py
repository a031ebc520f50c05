"""One LMDB environment per shard: lazy open, map growth, retrying transactions.

A shard env (`shard-NNN/`) holds four named dbs: `policy` (adapter_id -> PolicyRecord JSON),
`revision` and `blob` (`adapter_id@rev` -> RevisionRecord JSON / safetensors bytes) and `meta`
(`blob_bytes` -> decimal counter). Envs open on first use with a modest map; a write that
fills the map is aborted by LMDB (nothing half-written), the map doubles and the same
transaction function runs again, so write functions must compute everything inside the txn.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import lmdb
import xxhash

from .errors import CatalogError

T = TypeVar("T")
MiB = 1 << 20
DB_NAMES = (b"policy", b"revision", b"blob", b"meta")


def shard_of(adapter_id: str, shards: int) -> int:
    """The shard of an adapter: xxh3_64(adapter_id) % shards."""
    return xxhash.xxh3_64_intdigest(adapter_id.encode()) % shards


def shard_dirname(index: int) -> str:
    return f"shard-{index:03d}"


@dataclass(slots=True)
class ShardOptions:
    """How shard envs are opened. `sync=False` trades OS-crash durability for bulk speed."""

    initial_map_size: int = 64 * MiB
    max_map_size: int = 1 << 40
    readonly: bool = False
    sync: bool = True
    max_readers: int = 1024

    def __post_init__(self) -> None:
        if not 1 * MiB <= self.initial_map_size <= self.max_map_size:
            raise ValueError("need 1 MiB <= initial_map_size <= max_map_size")


class Dbs(NamedTuple):
    policy: object
    revision: object
    blob: object
    meta: object


class Shard:
    """One shard's LMDB env; opened lazily, reopened after another process grows the map."""

    def __init__(self, path: Path, options: ShardOptions) -> None:
        self.path = path
        self.options = options
        self._env: lmdb.Environment | None = None
        self._dbs: Dbs | None = None
        self._lock = threading.Lock()

    def exists(self) -> bool:
        return (self.path / "data.mdb").exists()

    def _open(self, create: bool) -> bool:
        with self._lock:
            if self._env is not None:
                return True
            if not create and not self.exists():
                return False
            o = self.options
            env = lmdb.open(
                str(self.path), map_size=o.initial_map_size, max_dbs=len(DB_NAMES), readonly=o.readonly,
                sync=o.sync, metasync=o.sync, readahead=False, meminit=False, max_readers=o.max_readers,
            )
            if not o.readonly:
                env.reader_check()  # drop reader slots of killed processes
            # no explicit txn: a handle opened inside a read txn dies with that txn
            self._dbs = Dbs(*(env.open_db(n, create=not o.readonly) for n in DB_NAMES))
            self._env = env
            return True

    def _begin(self, write: bool) -> lmdb.Transaction:
        try:
            return self._env.begin(write=write, buffers=not write)
        except lmdb.MapResizedError:  # another process grew the map: adopt its size
            self._env.set_mapsize(0)
            return self._env.begin(write=write, buffers=not write)

    def read(self, fn: Callable[[lmdb.Transaction, Dbs], T], default: T = None) -> T:
        """Run `fn(txn, dbs)` in a read txn (buffers are zero-copy views valid inside `fn`)."""
        if not self._open(create=False):
            return default
        with self._begin(write=False) as txn:
            return fn(txn, self._dbs)

    def write(self, fn: Callable[[lmdb.Transaction, Dbs], T], reserve: int = 0) -> T:
        """Run `fn(txn, dbs)` in one write txn and commit; on a full map grow it and run `fn` again.

        `reserve`: bytes the txn is about to add; the map is grown first if they would not fit,
        so a large blob is not copied into a txn that is bound to fail.
        """
        if self.options.readonly:
            raise CatalogError(f"{self.path}: catalog is open read-only")
        self._open(create=True)
        if reserve:
            self._ensure_room(reserve)
        while True:
            try:
                with self._begin(write=True) as txn:
                    return fn(txn, self._dbs)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.DiskError as e:
                raise CatalogError(f"{self.path}: disk error, transaction not committed: {e}") from None

    def _ensure_room(self, nbytes: int) -> None:
        info, psize = self._env.info(), self._env.stat()["psize"]
        need = (info["last_pgno"] + 1) * psize + 2 * nbytes + MiB  # copy-on-write may touch pages twice
        size = info["map_size"]
        while size < need and size < self.options.max_map_size:
            size = min(size * 2, self.options.max_map_size)
        if size != info["map_size"]:
            self._env.set_mapsize(size)

    def _grow(self) -> None:
        size = self._env.info()["map_size"]
        if size >= self.options.max_map_size:
            raise CatalogError(
                f"{self.path}: LMDB map full at {size} bytes (max {self.options.max_map_size}); "
                "the transaction was rolled back and nothing was lost"
            )
        try:
            self._env.set_mapsize(min(size * 2, self.options.max_map_size))
        except lmdb.Error as e:
            raise CatalogError(f"{self.path}: cannot grow LMDB map beyond {size} bytes: {e}") from None

    def stats(self) -> dict:
        """Entry counts, logical blob bytes and on-disk bytes of this shard."""

        def count(txn, dbs):
            raw = txn.get(b"blob_bytes", db=dbs.meta)
            info = self._env.info()
            psize = self._env.stat()["psize"]
            return {
                "adapters": txn.stat(dbs.policy)["entries"],
                "revisions": txn.stat(dbs.revision)["entries"],
                "bytes": int(bytes(raw)) if raw is not None else 0,
                "disk_bytes": (info["last_pgno"] + 1) * psize,
                "map_size": info["map_size"],
            }

        empty = {"adapters": 0, "revisions": 0, "bytes": 0, "disk_bytes": 0, "map_size": 0}
        return self.read(count, default=empty)

    def sync(self) -> None:
        if self._env is not None and not self.options.readonly:
            self._env.sync(True)

    def close(self) -> None:
        with self._lock:
            if self._env is not None:
                self._env.close()
                self._env, self._dbs = None, None


def add_blob_bytes(txn: lmdb.Transaction, dbs: Dbs, delta: int) -> None:
    """Add to the shard's logical blob-byte counter inside a write txn."""
    raw = txn.get(b"blob_bytes", db=dbs.meta)
    txn.put(b"blob_bytes", str((int(bytes(raw)) if raw else 0) + delta).encode(), db=dbs.meta)
