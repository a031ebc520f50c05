"""One LMDB environment per shard: lazy open, map growth, retrying transactions.

A shard env (`shard-NNN/`) holds four named dbs: `policy` (adapter_id -> PolicyRecord JSON),
`revision` and `blob` (`adapter_id@rev` -> RevisionRecord JSON / safetensors bytes) and `meta`
(`blob_bytes` -> decimal counter). Envs open on first use with a modest map; a write that
fills the map is aborted by LMDB (nothing half-written), the map doubles and the same
transaction function runs again, so write functions must compute everything inside the txn.
A shard with damaged or missing files raises ShardUnavailable; the other shards are unaffected.

Growing the map (`set_mapsize`) remaps the file, which LMDB leaves undefined while any txn of
the process is open: a zero-copy buffer another thread reads would point into the old mapping.
So every txn (and every read of the meta page through the map) holds the shard's `MapLock`
shared side for its life, and a growth takes the exclusive side.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import lmdb
import xxhash

from .errors import CatalogError, ShardUnavailable
from .shardfile import DATA_FILE, size_fault, unopened_fault

T = TypeVar("T")
MiB = 1 << 20
CATALOG_META = "catalog.json"
DB_NAMES = (b"policy", b"revision", b"blob", b"meta")
log = logging.getLogger("loraserve.catalog")


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


class MapLock:
    """Readers-writer lock of one env's memory map: txns share it, `set_mapsize` excludes them.

    Writer-preferring (a waiting growth stops new txns, so readers cannot starve it), and
    re-entrant on the shared side for a thread that holds it already (a nested read must not
    wait behind a growth that waits for that very thread). A thread holding the shared side
    may not take the exclusive one (RuntimeError, instead of a deadlock).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # shared holds, all threads
        self._growing = False
        self._waiting = 0  # threads waiting for the exclusive side
        self._mine = threading.local()  # this thread's shared holds

    def acquire_shared(self) -> None:
        mine = getattr(self._mine, "n", 0)
        with self._cond:
            if not mine:
                while self._growing or self._waiting:
                    self._cond.wait()
            self._readers += 1
        self._mine.n = mine + 1

    def release_shared(self) -> None:
        self._mine.n -= 1
        with self._cond:
            self._readers -= 1
            if not self._readers and self._waiting:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        if getattr(self._mine, "n", 0):
            raise RuntimeError("this thread holds the shared side of the map lock")
        with self._cond:
            self._waiting += 1
            while self._growing or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._growing = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._growing = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()


class Dbs(NamedTuple):
    policy: object
    revision: object
    blob: object
    meta: object


class Shard:
    """One shard's LMDB env; opened lazily, reopened after another process grows the map.

    Before the env is opened and before every txn the shard's files are checked (module
    `shardfile`): a shard whose data file is truncated, removed or replaced, or whose catalog
    directory is gone, raises ShardUnavailable (503) instead of letting LMDB fault on a missing
    page. `fault` is the latest check's verdict (None: healthy); it is not sticky.
    """

    def __init__(self, catalog_dir: Path, index: int, options: ShardOptions) -> None:
        self.index = index
        self.path = Path(catalog_dir) / shard_dirname(index)
        self.options = options
        self.fault: str | None = None
        self._env: lmdb.Environment | None = None
        self._dbs: Dbs | None = None
        self._psize = 0
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the data file the env maps
        self._read_only_env = False  # opened read-only though the catalog is not (see _open_env)
        self._lock = threading.Lock()
        self._map = MapLock()  # txns share the mapping; set_mapsize and close exclude them
        # the checked paths as strings, made once: a health check runs before every read
        self._data_path = str(self.data_file)
        self._anchor_path = str(self.anchor)

    @property
    def data_file(self) -> Path:
        return self.path / DATA_FILE

    @property
    def anchor(self) -> Path:
        """The catalog's `catalog.json`: without it the catalog directory is gone."""
        return self.path.parent / CATALOG_META

    def exists(self) -> bool:
        """Whether the data file holds an environment: a zero-length one was never initialized
        (see `shardfile`), so a read finds nothing and the first write lets LMDB initialize it."""
        try:
            return self.data_file.stat().st_size > 0
        except FileNotFoundError:
            return False

    # -- health ----------------------------------------------------------------------------
    def diagnose(self) -> str | None:
        """Why this shard cannot be used now (None: it can); kept in `fault`, changes logged.

        Never reads a data page: stats of the files, and of an open env only its meta page,
        once the file is known to hold it.
        """
        return self._diagnose()[0]

    def _diagnose(self) -> tuple[str | None, int]:
        """(`diagnose()`'s verdict, the meta page's last_txnid as the check read it; 0 when it
        did not read it)."""
        env = self._env
        txnid = 0
        if not os.path.exists(self._anchor_path):
            fault = f"{CATALOG_META} is missing (catalog directory removed?)"
        elif env is None:
            fault = unopened_fault(self.data_file)
        else:
            fault, txnid = self._mapped_fault(env)
        if fault != self.fault:
            if fault:
                log.warning("catalog shard %d (%s) unavailable: %s", self.index, self.path, fault)
            else:
                log.info("catalog shard %d (%s) serves again", self.index, self.path)
        self.fault = fault
        return fault, txnid

    def _mapped_fault(self, env: lmdb.Environment) -> tuple[str | None, int]:
        try:
            st = os.stat(self._data_path)
        except FileNotFoundError:
            return f"{DATA_FILE} was removed while in use", 0
        except OSError as e:
            return f"{DATA_FILE} cannot be checked: {e.strerror}", 0
        if (st.st_dev, st.st_ino) != self._ident:
            return f"{DATA_FILE} was replaced while in use (restart to serve the new file)", 0
        if st.st_size < 2 * self._psize:  # the meta pages themselves are gone: do not read them
            return size_fault(st.st_size, self._psize, 1), 0
        with self._map.shared():  # the meta page is read through the map
            info = env.info()
        last = info["last_pgno"]
        if size_fault(st.st_size, self._psize, last) is None:
            return None, info["last_txnid"]
        # another process may have committed (grown the file) between the stat and the meta
        # read: only a size taken after the meta read can prove truncation
        try:
            return size_fault(os.stat(self._data_path).st_size, self._psize, last), info["last_txnid"]
        except OSError:
            return f"{DATA_FILE} was removed while in use", 0

    def follow_file(self) -> None:
        """Close the env if the data file at the path is no longer the one it maps, so the next
        use opens the file there. Only for a shard host, whose owner checks before each request
        that the file at the path is the shard's own (`shardfile.DataFileWatch`): the host may
        have opened a replacement in the instant before its owner noticed one."""
        env, ident = self._env, self._ident
        if env is None:
            return
        try:
            st = os.stat(self._data_path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) != ident:
            self.close()

    def _check(self) -> None:
        if (fault := self.diagnose()) is not None:
            raise self.unavailable(fault)

    def unavailable(self, reason: str) -> ShardUnavailable:
        return ShardUnavailable(f"catalog shard {self.index} ({self.path.name}) is unavailable: {reason}",
                                [self.index])

    # -- env -------------------------------------------------------------------------------
    def _open(self, create: bool) -> bool:
        """Open the env if needed; False when there is none and `create` is False (an empty shard).
        `create` (a write): an env that had to be opened read-only is opened read-write again."""
        with self._lock:
            if self._env is not None and not (create and self._read_only_env):
                return True
            if self._env is not None:
                self._close_env()
            self._check()
            if not create and not self.exists():
                return False
            return self._open_env(create)

    def _lmdb_open(self, readonly: bool) -> lmdb.Environment:
        o = self.options
        return lmdb.open(str(self.path), map_size=o.initial_map_size, max_dbs=len(DB_NAMES), readonly=readonly,
                         sync=o.sync, metasync=o.sync, readahead=False, meminit=False, max_readers=o.max_readers)

    def _open_env(self, write: bool = False) -> bool:
        """Open and check the env; False when a read-only open finds no dbs yet (empty for now).
        For reads, a data file the OS will not open for writing (read-only, immutable) is
        opened read-only: the shard reads on, and a write opens it read-write again."""
        o = self.options
        readonly = o.readonly
        try:
            try:
                env = self._lmdb_open(readonly)
            except lmdb.Error as e:
                if readonly or write or getattr(e, "code", None) not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                env, readonly = self._lmdb_open(True), True
        except lmdb.Error as e:
            raise self.unavailable(f"cannot open: {e}") from None
        try:
            psize, last = env.stat()["psize"], env.info()["last_pgno"]
            st = os.stat(self.data_file)  # after the meta read: a concurrent commit only grows it
            # checked before open_db, the first read of a data page
            if (fault := size_fault(st.st_size, psize, last)) is not None:
                self.fault = fault
                raise self.unavailable(fault)
            if not readonly:
                env.reader_check()  # drop reader slots of killed processes
            # no explicit txn: a handle opened inside a read txn dies with that txn
            dbs = Dbs(*(env.open_db(n, create=not readonly) for n in DB_NAMES))
        except lmdb.NotFoundError:
            # read-only, and the shard's creator (another process) has not committed its first
            # txn: nothing to read yet; the next read opens again
            env.close()
            return False
        except lmdb.Error as e:  # the main db's pages are damaged (MDB_CORRUPTED, ...)
            env.close()
            raise self.unavailable(f"cannot open: {e}") from e
        except BaseException:
            env.close()
            raise
        self._env, self._dbs, self._psize, self._ident = env, dbs, psize, (st.st_dev, st.st_ino)
        self._read_only_env = readonly and not o.readonly
        return True

    @contextlib.contextmanager
    def _txn(self, write: bool) -> Iterator[lmdb.Transaction]:
        """A txn (committed when the block ends normally, else aborted) with the map's shared
        side held for its life, so no thread of this process remaps the file under it."""
        self._map.acquire_shared()
        try:
            try:
                txn = self._env.begin(write=write, buffers=not write)
            except lmdb.MapResizedError:  # another process grew the map: adopt its size
                self._map.release_shared()
                try:
                    with self._map.exclusive():
                        self._env.set_mapsize(0)
                finally:
                    self._map.acquire_shared()
                txn = self._env.begin(write=write, buffers=not write)
            with txn:
                yield txn
        finally:
            self._map.release_shared()

    def generation(self) -> int | None:
        """The id of the last write transaction committed to this shard, by any process (LMDB's
        `last_txnid`, from the meta page); None while the env is not open. Health-checked
        first, like a read: ShardUnavailable when the shard's files are damaged. A read txn
        begun after this call sees at least this generation (`txn.id()`)."""
        if self._env is None:
            return None
        fault, txnid = self._diagnose()  # the check reads the meta page: its txnid is the answer
        if fault is not None:
            raise self.unavailable(fault)
        return txnid

    def read(self, fn: Callable[[lmdb.Transaction, Dbs], T], default: T = None, *,
             checked: bool = False) -> T:
        """Run `fn(txn, dbs)` in a read txn (buffers are zero-copy views valid inside `fn`);
        `default` when the shard was never written. ShardUnavailable when its files are damaged.
        `checked`: the caller has just health-checked the open shard (`generation()`), so the
        check is not made twice in a row (each is two stats and a meta read: on a cold resolve
        they cost more than the lookup itself)."""
        if not (checked and self._env is not None) and not self._open(create=False):
            return default
        if not checked:
            self._check()  # a truncation after this point (a narrow race) still faults
        try:
            with self._txn(write=False) as txn:
                return fn(txn, self._dbs)
        except lmdb.Error as e:  # a damaged page LMDB noticed (MDB_CORRUPTED, page not found, ...)
            raise self._failed("read failed", e) from e

    def write(self, fn: Callable[[lmdb.Transaction, Dbs], T], reserve: int = 0) -> T:
        """Run `fn(txn, dbs)` in one write txn and commit; on a full map grow it and run `fn` again.

        `reserve`: bytes the txn is about to add; the map is grown first if they would not fit,
        so a large blob is not copied into a txn that is bound to fail.
        """
        if self.options.readonly:
            raise CatalogError(f"{self.path}: catalog is open read-only")
        self._open(create=True)
        self._check()
        if reserve:
            self._ensure_room(reserve)
        while True:
            try:
                with self._txn(write=True) as txn:
                    return fn(txn, self._dbs)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as e:  # the OS refused the write (disk full, EIO, immutable file, ...)
                raise self._failed("write refused, transaction not committed", e) from e

    def _failed(self, what: str, error: lmdb.Error) -> ShardUnavailable:
        """The 503 of an LMDB failure on this shard; after a panic (LMDB marks the env unusable
        once a meta page write failed) the env is closed, so the next use opens it afresh."""
        if isinstance(error, lmdb.PanicError):
            with contextlib.suppress(RuntimeError):  # a nested read holds the map: a later use closes it
                self.close()
        return self.unavailable(f"{what}: {error}")

    def _ensure_room(self, nbytes: int) -> None:
        with self._map.exclusive():
            info, psize = self._env.info(), self._env.stat()["psize"]
            need = (info["last_pgno"] + 1) * psize + 2 * nbytes + MiB  # copy-on-write may touch pages twice
            size = info["map_size"]
            while size < need and size < self.options.max_map_size:
                size = min(size * 2, self.options.max_map_size)
            if size != info["map_size"]:
                self._env.set_mapsize(size)

    def _grow(self) -> None:
        with self._map.exclusive():
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
            self._close_env()

    def _close_env(self) -> None:
        """Close the env (under `_lock`), once no txn of this process uses the map."""
        with self._map.exclusive():
            if self._env is not None:
                self._env.close()
                self._env, self._dbs, self._ident = None, None, None


def add_blob_bytes(txn: lmdb.Transaction, dbs: Dbs, delta: int) -> None:
    """Add to the shard's logical blob-byte counter inside a write txn."""
    raw = txn.get(b"blob_bytes", db=dbs.meta)
    txn.put(b"blob_bytes", str((int(bytes(raw)) if raw else 0) + delta).encode(), db=dbs.meta)
