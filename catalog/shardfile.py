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
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

DATA_FILE = "data.mdb"
MDB_MAGIC = 0xBEEFC0DE
# offsets inside a meta page: 16-byte page header, then MDB_meta (magic, version, address,
# mapsize, two MDB_db of 48 bytes: the free db's md_pad is the page size, then last_pg, txnid)
_PSIZE_AT, _MAGIC_AT, _LAST_AT = 40, 16, 136
_U32, _U64 = struct.Struct("=I"), struct.Struct("=Q")
META_BYTES = _LAST_AT + 16  # through mm_txnid
_SUPPORTED = struct.calcsize("P") == 8


def size_fault(size: int, psize: int, last_pgno: int) -> str | None:
    """Why a data file of `size` bytes cannot back an env of page size `psize` whose last used
    page is `last_pgno` (None: it can)."""
    need = max(last_pgno + 1, 2) * psize  # at least the two meta pages
    if size < need:
        return f"{DATA_FILE} is truncated: {size} bytes on disk, {need} in use"
    return None


def _meta(fd: int, offset: int) -> tuple[int, int] | None:
    """(page size, last used page) of the meta page at `offset`; None if it is short or not LMDB's."""
    raw = os.pread(fd, META_BYTES, offset)
    if len(raw) < META_BYTES or _U32.unpack_from(raw, _MAGIC_AT)[0] != MDB_MAGIC:
        return None
    return _U32.unpack_from(raw, _PSIZE_AT)[0], _U64.unpack_from(raw, _LAST_AT)[0]


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
        return size_fault(os.fstat(fd).st_size, psize, max(first[1], second[1]))
    except OSError as e:
        return f"{DATA_FILE} cannot be read: {e.strerror}"
    finally:
        os.close(fd)
