"""Map growth under readers of the same process (issue 28 row 1).

LMDB leaves `set_mapsize` undefined while any transaction of the process is open: it unmaps and
remaps the file, and a zero-copy buffer a reader holds points into the old mapping (a crash or
foreign bytes). A `Shard` serializes them: every txn holds the map's shared side for its life,
and growing the map takes the exclusive side.
"""
from __future__ import annotations

import functools
import threading
import time

import pytest

from loraserve.catalog.shards import MiB, MapLock, ShardOptions
from loraserve.catalog.store import Catalog

READERS = 8
BLOBS = 24  # small ones the readers check
SMALL = 48 * 1024


def pattern(i: int, size: int) -> bytes:
    return bytes((i * 31 + j) & 0xFF for j in range(256)) * (size // 256)


def put(txn, dbs, key: bytes, value: bytes) -> None:
    txn.put(key, value, db=dbs.blob)


def check_some(txn, dbs, keys: list[bytes], expected: dict[bytes, bytes]) -> int:
    """Read zero-copy views, let other threads run while they are held, then check every byte."""
    views = [(k, txn.get(k, db=dbs.blob)) for k in keys]
    time.sleep(0.0005)  # a writer growing the map now would pull the pages from under the views
    for k, view in views:
        if view is None or len(view) != len(expected[k]) or bytes(view) != expected[k]:
            raise AssertionError(f"{k!r}: the zero-copy view changed under its reader")
    return len(views)


def test_map_grows_while_threads_hold_zero_copy_views(tmp_path) -> None:
    opts = ShardOptions(initial_map_size=1 * MiB)
    with Catalog.create(tmp_path / "cat", shards=1, options=opts) as cat:
        shard = cat.shard(0)
        expected = {f"small{i}".encode(): pattern(i, SMALL) for i in range(BLOBS)}
        for k, v in expected.items():
            shard.write(functools.partial(put, key=k, value=v), reserve=len(v))
        start_size = shard.stats()["map_size"]
        stop, errors, reads = threading.Event(), [], [0] * READERS

        def reader(n: int) -> None:
            keys = list(expected)
            i = n
            try:
                while not stop.is_set():
                    picked = [keys[(i + j) % len(keys)] for j in range(3)]
                    reads[n] += shard.read(functools.partial(check_some, keys=picked, expected=expected))
                    i += 1
            except BaseException as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(READERS)]
        for t in threads:
            t.start()
        try:
            for n in range(10):  # 1 MiB map -> 64+ MiB: several remaps while views are held
                big = pattern(100 + n, (2 + n) * MiB)
                # even n: the map is grown before the txn (reserve); odd n: after MapFullError
                shard.write(functools.partial(put, key=f"big{n}".encode(), value=big),
                            reserve=len(big) if n % 2 == 0 else 0)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors, errors[:3]
        assert min(reads) > 0
        assert shard.stats()["map_size"] >= 16 * start_size
        for n in range(10):  # the big ones were written whole
            got = shard.read(lambda txn, dbs, n=n: bytes(txn.get(f"big{n}".encode(), db=dbs.blob)))
            assert got == pattern(100 + n, (2 + n) * MiB)


def test_map_lock_readers_share_and_exclude_the_grower() -> None:
    lock = MapLock()
    order: list[str] = []
    with lock.shared():
        with lock.shared():  # re-entrant for a thread that holds it already
            pass
        grower = threading.Thread(target=lambda: (lock.acquire_exclusive(), order.append("grow"),
                                                  lock.release_exclusive()))
        grower.start()
        time.sleep(0.05)
        assert order == []  # waits for the reader
        order.append("read done")
    grower.join(5)
    assert order == ["read done", "grow"]
    with lock.shared():
        with pytest.raises(RuntimeError, match="holds the shared side"):
            lock.acquire_exclusive()
