"""One maintenance job per store at a time: a lease object in the bucket, taken by conditional PUTs.

`loraserve catalog compact-log` and `catalog store-gc` each rewrite or delete shared objects
(store_log.compact, store_gc.collect). Two of them interleaving on one store could lose change-
log entries or delete what the other just found live, so each holds `maintenance-lease.json`
for its run:

- take: the lease object is created with If-None-Match: * (it did not exist), or, when the one
  there has expired, replaced with If-Match: its ETag as read (nobody took it since). Either
  condition failing means another process got there first: LeaseHeld (409), naming the holder.
  The object is read back after the write, and a body that is not ours is LeaseHeld too (a
  store that ignores the conditions is caught here unless two writers interleave exactly).
- keep: a thread renews it every `ttl_s / 3` with If-Match on the ETag of our last write. A
  renewal that fails (the lease expired and another process took it) marks the lease lost.
- fence: the job calls `check()` before each step that deletes or rewrites shared objects. It
  raises LeaseLost when a renewal failed, or when less than half the lease's time remains by
  our clock. So a holder paused past its expiry stops at its next step, before it writes.
- release: the body is rewritten as expired (If-Match), so the next job takes it at once.

The expiry is the holder's wall-clock time; hosts' clocks must agree within a small fraction of
`ttl_s` (the change log assumes `skew_s` already). S3 (since 2024), MinIO and moto honour both
conditions on PutObject.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import CatalogError
from .store_objects import ObjectStore, WriteConflict

LEASE = "maintenance-lease.json"


class LeaseHeld(CatalogError):
    """Another process holds the store's maintenance lease."""

    status = 409


class LeaseLost(CatalogError):
    """This process's lease expired or was taken over: its job must stop before writing."""

    status = 409


class StoreLease:
    """The store's maintenance lease, held by one job (module doc)."""

    def __init__(self, store: ObjectStore, job: str, ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.job, self.ttl_s, self.clock = store, job, ttl_s, clock
        self.key = store.key(LEASE)
        self.owner = f"{socket.gethostname()}:{uuid.uuid4().hex[:12]}"
        self.etag: str | None = None
        self.expires = 0.0
        self.lost: str | None = None  # why, once a renewal failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, expires: float) -> bytes:
        return json.dumps({"owner": self.owner, "job": self.job, "expires": expires,
                           "nonce": uuid.uuid4().hex}).encode()  # a new ETag on every write

    def acquire(self) -> None:
        """Take the lease (module doc); LeaseHeld when another process holds it."""
        found = self.store.get_with_etag(self.key)
        if found is not None:
            held = json.loads(found[0])
            if held["expires"] > self.clock():
                raise LeaseHeld(f"{self.store.uri}: {held['job']} by {held['owner']} holds the maintenance lease "
                                f"for {held['expires'] - self.clock():.0f} s more")
        expires = self.clock() + self.ttl_s
        body = self._body(expires)
        try:
            etag = self.store.put_if(self.key, body, None if found is None else found[1])
        except WriteConflict:
            raise LeaseHeld(f"{self.store.uri}: another process took the maintenance lease first") from None
        mine = self.store.get_with_etag(self.key)
        if mine is None or mine[0] != body:
            raise LeaseHeld(f"{self.store.uri}: another process took the maintenance lease first")
        self.etag, self.expires = etag, expires

    def renew(self) -> None:
        """Extend the lease by `ttl_s`; LeaseLost (and `lost` set) when it was taken over."""
        with self._lock:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            expires = self.clock() + self.ttl_s
            try:
                self.etag = self.store.put_if(self.key, self._body(expires), self.etag)
            except WriteConflict:
                self.lost = f"{self.store.uri}: the maintenance lease of {self.job} was taken over"
                raise LeaseLost(self.lost) from None
            self.expires = expires

    def check(self) -> None:
        """Before a step that deletes or rewrites shared objects: LeaseLost unless the lease is
        ours with at least half its time left."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if self.expires - self.clock() < self.ttl_s / 2:
            raise LeaseLost(f"{self.store.uri}: the maintenance lease of {self.job} was not renewed in time")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._renewing, name="loraserve-store-lease", daemon=True)
        self._thread.start()

    def _renewing(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLost:
                return
            except CatalogError:  # the store unreachable: check() fails once the time runs short
                continue

    def release(self) -> None:
        """Stop renewing; mark the lease expired so the next job takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        with self._lock:
            if self.lost is None and self.etag is not None:
                try:
                    self.store.put_if(self.key, self._body(0.0), self.etag)
                except CatalogError:  # taken over or unreachable: it expires on its own
                    pass


@contextmanager
def maintenance(store: ObjectStore, job: str, ttl_s: float = 60.0) -> Iterator[StoreLease]:
    """The store's maintenance lease for the duration (taken, kept, released: module doc)."""
    lease = StoreLease(store, job, ttl_s)
    lease.acquire()
    lease.start()
    try:
        yield lease
    finally:
        lease.release()
