"""Checks of a shard's LMDB data file that never read a page through LMDB's memory map.

LMDB maps `data.mdb` and follows page numbers into the map; a page past the end of the file
(the file was truncated under us) is not an error but SIGBUS, which kills the process. So the
file is checked against what LMDB will read before any txn: every page up to the environment's
last used page must lie inside the file. A healthy file only grows (LMDB writes a txn's pages
before the meta page that makes them reachable), so `size >= (last_pgno + 1) * psize` holds for
every committed state and a failure means damage.

Before an env is opened the same facts come from the two meta pages, read with `pread` (LMDB 0.9
on-disk layout, data version 1, 64-bit, native byte order): a short or foreign file is an error
here, not a mapping LMDB would fault on. A zero-length file is one LMDB never initialized (its
creator was killed before writing the meta pages, or is writing them now): LMDB treats it as a
new environment, and so does the catalog (an empty shard), so `materialize` stays safe to kill.

`DataFileWatch` makes the same checks for a process that never maps the file at all (an
`IsolatedCatalog`, whose shard hosts map it): the current meta page's `txnid` is the shard's
write generation, read with one `pread`, which on a damaged disk returns bytes or EIO, never a
signal.
"""
from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import NamedTuple

DATA_FILE = "data.mdb"
MDB_MAGIC = 0xBEEFC0DE
# offsets inside a meta page: 16-byte page header, then MDB_meta (magic, version, address,
# mapsize, two MDB_db of 48 bytes: the free db's md_pad is the page size, then last_pg, txnid)
_PSIZE_AT, _MAGIC_AT, _LAST_AT, _TXNID_AT = 40, 16, 136, 144
_U32, _U64 = struct.Struct("=I"), struct.Struct("=Q")
META_BYTES = _TXNID_AT + 8  # through mm_txnid
_PAGE_SIZES = frozenset(1 << n for n in range(9, 17))  # 512 B .. 64 KiB
_SUPPORTED = struct.calcsize("P") == 8


def size_fault(size: int, psize: int, last_pgno: int) -> str | None:
    """Why a data file of `size` bytes cannot back an env of page size `psize` whose last used
    page is `last_pgno` (None: it can)."""
    need = max(last_pgno + 1, 2) * psize  # at least the two meta pages
    if size < need:
        return f"{DATA_FILE} is truncated: {size} bytes on disk, {need} in use"
    return None


class Meta(NamedTuple):
    """One meta page: page size, last used page, id of the txn that wrote it."""

    psize: int
    last_pgno: int
    txnid: int


def _parse_meta(raw: bytes, at: int = 0) -> Meta | None:
    """The meta page at `raw[at:]`; None if it is short or not LMDB's."""
    if len(raw) < at + META_BYTES or _U32.unpack_from(raw, at + _MAGIC_AT)[0] != MDB_MAGIC:
        return None
    return Meta(_U32.unpack_from(raw, at + _PSIZE_AT)[0], _U64.unpack_from(raw, at + _LAST_AT)[0],
                _U64.unpack_from(raw, at + _TXNID_AT)[0])


def _meta(fd: int, offset: int) -> Meta | None:
    """The meta page at `offset`; None if it is short or not LMDB's."""
    return _parse_meta(os.pread(fd, META_BYTES, offset))


def unopened_fault(path: Path) -> str | None:
    """Why the data file at `path` cannot be opened safely (None: it can, or it does not exist).

    Reads the two meta pages with `pread` and takes the larger last page of the two (both were
    committed, so the file must cover both). A zero-length file is not initialized yet: no fault.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # never written: an empty shard
    except OSError as e:
        return f"{DATA_FILE} cannot be opened: {e.strerror}"
    try:
        if not _SUPPORTED or os.fstat(fd).st_size == 0:
            return None  # 64-bit layout only (LMDB's own checks remain); or never initialized
        first = _meta(fd, 0)
        if first is None:
            return f"{DATA_FILE} is truncated or not an LMDB file ({os.fstat(fd).st_size} bytes)"
        psize = first[0]
        if psize < 512 or psize & (psize - 1):
            return f"{DATA_FILE} has a damaged meta page (page size {psize})"
        second = _meta(fd, psize)
        if second is None:
            return f"{DATA_FILE} is truncated: {os.fstat(fd).st_size} bytes, the second meta page is missing"
        # the size after the metas: a commit in between only grows the file
        return size_fault(os.fstat(fd).st_size, psize, max(first.last_pgno, second.last_pgno))
    except OSError as e:
        return f"{DATA_FILE} cannot be read: {e.strerror}"
    finally:
        os.close(fd)


class DataFileWatch:
    """Health and write generation of one shard's data file, for a process that never maps it.

    `check()` -> (fault or None, generation or None): the file is stat()ed and both meta pages
    are read with one `pread` (the page size is learnt once). The generation is the larger
    `txnid` of the two metas, the one LMDB serves (a read txn's `id()`); None while the file is
    absent or empty (nothing committed yet: an empty shard). The first non-empty file seen is
    the shard's: another inode later is a replacement, a missing file a removal (faults until
    that very inode is back), as for a shard whose env is mapped. Thread-safe.
    """

    def __init__(self, data_file: Path, anchor: Path) -> None:
        self._path, self._anchor = str(data_file), str(anchor)
        self._fd: int | None = None  # open on the shard's inode once seen
        self._ident: tuple[int, int] | None = None
        self._psize = 0
        self._lock = threading.Lock()

    def check(self) -> tuple[str | None, int | None]:
        if not os.path.exists(self._anchor):
            return "catalog.json is missing (catalog directory removed?)", None
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return (None if self._ident is None else f"{DATA_FILE} was removed while in use"), None
        except OSError as e:
            return f"{DATA_FILE} cannot be checked: {e.strerror}", None
        if self._ident is None:
            if st.st_size == 0 or not _SUPPORTED:
                return None, None  # never initialized: an empty shard
            if (fault := self._adopt(st)) is not None:
                return fault, None
        elif (st.st_dev, st.st_ino) != self._ident:
            return f"{DATA_FILE} was replaced while in use (restart to serve the new file)", None
        try:
            return self._metas(st.st_size)
        except OSError as e:
            return f"{DATA_FILE} cannot be read: {e.strerror}", None

    def _adopt(self, st: os.stat_result) -> str | None:
        """Open the first non-empty file seen as the shard's (a fault if it cannot be opened)."""
        with self._lock:
            if self._ident is not None:
                return None
            try:
                fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                return f"{DATA_FILE} cannot be opened: {e.strerror}"
            st2 = os.fstat(fd)
            self._fd, self._ident = fd, (st2.st_dev, st2.st_ino)
            return None

    def _metas(self, size: int) -> tuple[str | None, int | None]:
        """(fault, generation) from both meta pages of a file of `size` bytes (a stat before)."""
        fd, psize = self._fd, self._psize or 4096
        if fd is None:
            return "the catalog is closed", None
        raw = os.pread(fd, psize + META_BYTES, 0)
        first = _parse_meta(raw)
        if first is not None and first.psize != psize and first.psize in _PAGE_SIZES:
            self._psize = psize = first.psize  # learnt now: read the second meta where it is
            raw = os.pread(fd, psize + META_BYTES, 0)
            first = _parse_meta(raw)
        if first is None:
            return f"{DATA_FILE} is truncated or not an LMDB file ({size} bytes)", None
        if first.psize != psize or psize not in _PAGE_SIZES:
            return f"{DATA_FILE} has a damaged meta page (page size {first.psize})", None
        second = _parse_meta(raw, psize)
        if second is None:
            return f"{DATA_FILE} is truncated or damaged: the second meta page is missing", None
        last = max(first.last_pgno, second.last_pgno)
        if (fault := size_fault(size, psize, last)) is not None:
            # another process may have committed (grown the file) between the stat and the
            # read: only a size taken after the meta read can prove truncation
            fault = size_fault(os.fstat(fd).st_size, psize, last)
            if fault is not None:
                return fault, None
        return None, max(first.txnid, second.txnid)

    def signature(self) -> tuple | None:
        """What changes when the file is written, truncated, replaced or removed (a probe of a
        quarantined shard is due early when it does); None when it cannot be stat()ed."""
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
