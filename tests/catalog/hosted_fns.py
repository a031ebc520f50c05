"""Transaction bodies the isolated-catalog tests send to a shard host (importable there: light)."""
from __future__ import annotations

import os
import signal
import time


def crash(txn, dbs, delay: float = 0.0) -> None:
    """What a read of a garbage page does to the process that maps it, on purpose."""
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGSEGV)


def hang(txn, dbs, seconds: float) -> None:
    time.sleep(seconds)


def host_pid(txn, dbs) -> int:
    return os.getpid()


def read_late(txn, dbs, key: bytes, delay: float) -> int:
    """Take a zero-copy view of a blob, wait (the test truncates the file meanwhile), then read
    it: a read in flight when the file was cut, as a real page-in would be."""
    view = txn.get(key, db=dbs.blob)
    time.sleep(delay)
    return len(bytes(view))
