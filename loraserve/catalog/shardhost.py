"""Shard hosts: small processes that map a group of catalog shards for a serving process.

LMDB maps each shard's `data.mdb` into memory and follows page numbers and sizes it reads from
the file; a page overwritten with garbage sends it past the map, which is a signal (SIGSEGV,
SIGBUS), not an exception, and ends whichever process made the read. So a serving process
(`IsolatedCatalog`, module `isolated`) maps no shard itself: a shard host does, and answers one
request at a time over a Unix socket pair. When a host dies, the request in flight, and so the
shard it read, is known exactly; the owner reaps it and starts another for the next request.

Protocol (multiprocessing `Connection` framing, pickles): the owner sends `(op, shard, payload)`
and gets `("ok", value)` or `("err", class, message, shards, damaged)`; `damaged` says LMDB
itself found the shard's pages bad on a read (the owner quarantines the shard). A `blobs` answer
is `("blobs", [size or error, ...])` followed by one raw frame per blob, sent straight from the
map (no pickling of the bytes) and received into the `bytearray` the caller gets. Ops:

    read (fn, default)   Shard.read(fn, default): fn is a picklable transaction body
    write (fn, reserve)  Shard.write(fn, reserve)
    blobs records        the verified blobs of records, one read txn
    stats / sync         Shard.stats() / Shard.sync()
    probe replay         reopen the env, walk every page of the record dbs, replay a read

Hosts are started with `subprocess` (a fresh interpreter, as multiprocessing's `spawn` would,
which a daemonic process such as the engine core may not use), never forked from a serving
process (threads, maybe CUDA). A host exits when its socket closes, so none outlives its owner.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import lmdb

from ..logs import configure_process_logging
from .errors import CatalogError, ShardUnavailable
from .shards import Shard, ShardOptions
from .store import verified_blobs

log = logging.getLogger("loraserve.catalog")

# the host's first lines: sys.path from the owner (a checkout run without an install finds the
# package too), then the loop; nothing else is imported before the path is set
_BOOT = ("import sys\nfrom multiprocessing.connection import Connection\n"
         "conn = Connection(int(sys.argv[1]))\npath, args = conn.recv()\n"
         "sys.path[:0] = [p for p in path if p not in sys.path]\n"
         "from loraserve.catalog.shardhost import serve\nserve(conn, *args)\n")
REPLAYED = ("read", "blobs")  # ops a probe may run again: reads only
INLINE_BYTES = 256 * 1024  # blobs of one answer up to this many bytes travel inside it
PIPELINE_BYTES = 64 * 1024  # requests sent ahead of their answers, at most (well below a socket buffer)
EXIT_UNREADABLE = 86  # a host's exit status when the kernel could not read a mapped page (EFAULT)
BOOT_TIMEOUT_S = 60.0  # a new host's start-up (an interpreter, the catalog's imports), bounded apart


# -- the host process ------------------------------------------------------------------------------

def _dumps(obj) -> bytes:
    """A message: plain pickle (nothing sent is a socket or a handle, so multiprocessing's own
    pickler, a new one per message with its reducer tables, is not needed)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def serve(conn: Connection, catalog_dir: str, options: dict) -> None:
    """A host's loop: answer requests until the owner closes the socket (or sends None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the owner's to handle
    configure_process_logging("shard-host", logging.WARNING,
                              "%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts, shards = ShardOptions(**options), {}
    try:
        conn.send(("ready", None))  # up: from here on the owner times each request
        while (msg := conn.recv()) is not None:
            op, index, payload = msg
            if index not in shards:
                shards[index] = Shard(Path(catalog_dir), index, opts)
            # the owner has just checked the file at the path (`DataFileWatch`), so reads skip
            # the shard's own check; a file cut in between is a signal here, which it contains
            shards[index].follow_file()
            _answer(conn, shards[index], op, payload)
    except (EOFError, OSError):  # the owner is gone
        pass
    finally:
        for shard in shards.values():
            shard.close()


def _answer(conn: Connection, shard: Shard, op: str, payload) -> None:
    try:
        if op == "blobs":
            if _send_blobs(conn, shard, payload):
                return
            reply = ("ok", None)  # the shard was never written
        else:
            reply = ("ok", _OPS[op](shard, payload))
        data = _dumps(reply)
    except Exception as e:  # noqa: BLE001 - every failure is answered, none ends the host
        data = _dumps(_error_reply(shard, op, e))
    conn.send_bytes(data)


def _send_blobs(conn: Connection, shard: Shard, records: list) -> bool:
    """Verify the records' blobs in one read txn and send them: up to INLINE_BYTES in the answer
    itself, else one frame each, straight from the map; False when the shard was never written
    (nothing sent)."""

    def send(txn, dbs) -> bool:
        views = verified_blobs(txn, dbs, records)
        head = [len(v) if isinstance(v, memoryview) else _error_entry(v) for v in views]
        blobs = [v for v in views if isinstance(v, memoryview)]
        if sum(map(len, blobs)) <= INLINE_BYTES:  # small: one message, one write
            conn.send_bytes(_dumps(("blobs", head, b"".join(blobs))))
            return True
        conn.send_bytes(_dumps(("blobs", head, None)))
        try:
            for v in blobs:
                conn.send_bytes(v)
        except OSError:  # EFAULT: the kernel met a page gone from the file (truncated meanwhile),
            os._exit(EXIT_UNREADABLE)  # or the owner left; no answer can follow half a reply
        return True

    return shard.read(send, checked=True) is not None


def _probe(shard: Shard, replay: tuple | None) -> int:
    """Whether a quarantined shard reads again: the env is opened afresh, every page of the
    policy, revision and meta dbs is read (keys and values) and every blob entry's node, then
    the read that failed runs again. A damaged page ends this host again, or raises."""
    shard.close()

    def walk(txn, dbs) -> int:
        seen = 0
        for db in (dbs.policy, dbs.revision, dbs.meta):
            for k, v in txn.cursor(db=db):
                seen += len(bytes(k)) + len(bytes(v))
        for k, v in txn.cursor(db=dbs.blob):
            seen += len(bytes(k)) + len(v)
        return seen

    seen = shard.read(walk, default=0)
    if replay is not None:
        op, payload = replay
        body = functools.partial(verified_blobs, records=payload) if op == "blobs" else payload[0]
        try:
            shard.read(body)
        except ShardUnavailable:
            raise
        except Exception:  # noqa: BLE001 - an answer (404, a corrupt blob): the pages read
            pass
    return seen


_OPS = {
    "read": lambda shard, p: shard.read(p[0], p[1], checked=True),
    "write": lambda shard, p: shard.write(p[0], p[1]),
    "stats": lambda shard, p: shard.stats(),
    "sync": lambda shard, p: shard.sync(),
    "probe": _probe,
}


def _error_entry(e: BaseException) -> tuple:
    return type(e), str(e), getattr(e, "shards", None)


def _error_reply(shard: Shard, op: str, e: BaseException) -> tuple:
    """The answer to a failed request. A catalog error goes back as it is; LMDB failing a read
    marks the shard damaged; anything else raised over the stored bytes (a record that does not
    decode) is the shard's 503 too, never the owner's 500."""
    if not isinstance(e, CatalogError):
        log.warning("catalog shard %d: %s failed", shard.index, op, exc_info=e)
        e = shard.unavailable(f"a stored record did not decode ({type(e).__name__}: {e})")
    damaged = op in REPLAYED and isinstance(e, ShardUnavailable) and isinstance(e.__cause__, lmdb.Error)
    return ("err", *_error_entry(e), damaged)


# -- the owner's side ------------------------------------------------------------------------------

class HostLost(Exception):
    """A shard host died or hung while it served a request (the message says how)."""


class _Timeout(Exception):
    pass


def unwrap(reply: tuple[str, object]):
    """The value of one `call_many` entry, or its error raised."""
    kind, value = reply
    if kind == "ok":
        return value
    if kind == "unsent":
        raise HostLost("did not take the request (ended before it)")
    raise value


def rebuild_error(cls: type, message: str, shards: list[int] | None, damaged: bool = False) -> Exception:
    """A catalog error sent by a host, as the owner raises it (`damaged` kept as an attribute)."""
    exc = cls.__new__(cls)
    exc.args = (message,)
    if issubclass(cls, ShardUnavailable):
        exc.shards = list(shards or [])
    exc.damaged = damaged
    return exc


@dataclasses.dataclass(slots=True)
class _Exchange:
    """Requests of one `call_many` (pickled) and how many of them are out."""

    datas: list
    conn: Connection
    sent: int


class ShardHost:
    """The owner's handle of one shard host process: started on first use and again after a
    death, one request at a time (callers queue on a lock), reaped when it ends.

    `call` returns a request's value or raises its error; HostLost when the host died (or did
    not answer within `timeout_s`: then it is killed) with the request in flight. A host found
    dead before a request was sent is replaced silently.
    """

    def __init__(self, catalog_dir: Path, options: ShardOptions, timeout_s: float = 60.0) -> None:
        self.catalog_dir, self.options, self.timeout_s = catalog_dir, options, timeout_s
        self.starts = 0  # processes started so far
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._booting = False  # started, its "ready" not read yet
        self._closed = False

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def call(self, op: str, index: int, payload=None):
        """One request's value; its error raised (HostLost when the host died with it)."""
        return unwrap(self.call_many([(op, index, payload)])[0])

    def call_many(self, calls: list[tuple[str, int, object]]) -> list[tuple[str, object]]:
        """Requests `(op, shard, payload)` in one exchange: sent ahead (up to PIPELINE_BYTES),
        their answers read in order. The host serves them one at a time, so a death is still
        one request's: its entry is ("lost", HostLost), those after it ("unsent", None) (never
        started: send them again); the others ("ok", value) or ("err", exception)."""
        return self.finish(self.begin(calls))

    def begin(self, calls: list[tuple[str, int, object]]) -> _Exchange:
        """First half of `call_many`: take the host and send what fits ahead. `finish` must
        follow (it gives the host back); between them, other hosts can be sent to."""
        datas = [_dumps(c) for c in calls]  # a bad payload fails here, host untouched
        self._lock.acquire()
        try:
            return _Exchange(datas, *self._send(datas))
        except BaseException:
            self._lock.release()
            raise

    def finish(self, ex: _Exchange) -> list[tuple[str, object]]:
        """Second half of `call_many`: read the answers (sending the rest as room frees up)."""
        out: list[tuple[str, object]] = []
        try:
            while True:
                for _ in range(ex.sent):
                    try:
                        reply = self._reply(ex.conn, time.monotonic() + self.timeout_s)
                    except (EOFError, OSError, _Timeout) as e:
                        out.append(("lost", self._lost(e)))
                        return out + [("unsent", None)] * (len(ex.datas) - len(out))
                    except BaseException:
                        self._stop(kill=True)  # an exchange left half-way: the next call starts afresh
                        raise
                    out.append(("err", rebuild_error(*reply[1:])) if reply[0] == "err" else reply)
                if len(out) == len(ex.datas):
                    return out
                ex.conn, ex.sent = self._send(ex.datas[len(out):])
        finally:
            self._lock.release()

    def _send(self, datas: list) -> tuple[Connection, int]:
        """Send requests ahead of their answers (at least one, at most PIPELINE_BYTES: the host
        writing answers while this side still writes cannot fill both socket buffers); the
        connection and how many were sent."""
        conn = self._ready()
        try:
            conn.send_bytes(datas[0])
        except OSError:  # died idle (killed from outside): the request never reached it
            self._stop()
            conn = self._ready()
            conn.send_bytes(datas[0])
        sent, ahead = 1, len(datas[0])
        for data in datas[1:]:
            if ahead + len(data) > PIPELINE_BYTES:
                break
            try:
                conn.send_bytes(data)
            except OSError:  # it died meanwhile: the answers read say which request it was on
                break
            sent, ahead = sent + 1, ahead + len(data)
        return conn, sent

    def _reply(self, conn: Connection, deadline: float) -> tuple:
        """`("ok", value)` or `("err", ...)` as the host sent it; a blobs answer as ("ok", blobs)."""
        deadline = self._booted(conn, deadline)
        reply = self._recv(conn, deadline)
        if reply[0] != "blobs":
            return reply
        _, head, inline = reply
        data, at = memoryview(inline) if inline is not None else None, 0
        out: list[bytearray | Exception] = []
        for entry in head:
            if not isinstance(entry, int):
                out.append(rebuild_error(*entry))
            elif data is not None:
                out.append(bytearray(data[at:at + entry]))
                at += entry
            else:  # a frame of its own, read straight into the caller's bytearray
                blob = bytearray(entry)
                self._wait(conn, deadline)
                conn.recv_bytes_into(blob)
                out.append(blob)
        return "ok", out

    def _booted(self, conn: Connection, deadline: float) -> float:
        """The request's deadline, once a host started for it has said it is up: its start-up
        (seconds on a busy machine) does not count against the request's `timeout_s`; it has
        BOOT_TIMEOUT_S of its own."""
        if not self._booting:
            return deadline
        self._wait(conn, time.monotonic() + max(BOOT_TIMEOUT_S, self.timeout_s))
        if conn.recv() != ("ready", None):
            raise EOFError("the shard host spoke before it was up")
        self._booting = False
        return max(deadline, time.monotonic() + self.timeout_s)

    def _recv(self, conn: Connection, deadline: float):
        self._wait(conn, deadline)
        return conn.recv()

    def _wait(self, conn: Connection, deadline: float) -> None:
        """Until the host's next message (or its end) can be read; _Timeout past `deadline`."""
        if not self._poller.poll(max(0, int((deadline - time.monotonic()) * 1000) + 1)):
            raise _Timeout

    def _ready(self) -> Connection:
        if self._closed:
            raise CatalogError(f"{self.catalog_dir}: the catalog is closed")
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()  # it died between requests: reap it
        return self._conn or self._start()

    def _start(self) -> Connection:
        ours, theirs = multiprocessing.Pipe(duplex=True)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), f"loraserve-shard-host {self.catalog_dir}"],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._conn, self._booting = ours, True
        self._poller = select.poll()  # made once: Connection.poll builds a selector per call
        self._poller.register(ours.fileno(), select.POLLIN)
        self.starts += 1
        ours.send((sys.path, (str(self.catalog_dir), dataclasses.asdict(self.options))))
        return ours

    def _lost(self, error: BaseException) -> HostLost:
        pid = self.pid
        if isinstance(error, _Timeout):
            self._stop(kill=True)
            return HostLost(f"(pid {pid}) did not answer within {self.timeout_s:g} s and was killed")
        code = self._stop()
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code == EXIT_UNREADABLE:
            how = "met an unreadable page of the shard (EFAULT) and exited"
        else:
            how = f"exited (status {code})"
        return HostLost(f"(pid {pid}) {how}")

    def _stop(self, kill: bool = False, grace_s: float = 5.0) -> int | None:
        """Close the socket and reap the process (killed first with `kill`, or when it does not
        exit within `grace_s` of the close); its exit code."""
        conn, proc = self._conn, self._proc
        self._conn = self._proc = None
        self._booting = False
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if kill:
            proc.kill()
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        """End the host (a request in flight for longer than 5 s is cut short) and reap it."""
        if not self._lock.acquire(timeout=5.0):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the call in flight sees the end and returns
            self._lock.acquire()
        try:
            self._closed = True
            self._stop()
        finally:
            self._lock.release()


def call_hosts(batches: list[tuple[ShardHost, list[tuple[str, int, object]]]]) -> list[list[tuple[str, object]]]:
    """`call_many` on several hosts at once: every host is sent its requests before any answer
    is read, so the hosts work in parallel. Hosts are taken in one global order (by id), so two
    callers never wait for each other's hosts in a cycle."""
    order = sorted(range(len(batches)), key=lambda i: id(batches[i][0]))
    begun: dict[int, _Exchange] = {}
    results: dict[int, list[tuple[str, object]]] = {}
    try:
        for i in order:
            begun[i] = batches[i][0].begin(batches[i][1])
    finally:
        for i in order:
            if i in begun:
                results[i] = batches[i][0].finish(begun[i])
    return [results[i] for i in range(len(batches))]


def close_hosts(hosts: list[ShardHost]) -> None:
    """Close every host (a catalog's finalizer: it must not hold the catalog)."""
    for host in hosts:
        try:
            host.close()
        except Exception:  # noqa: BLE001 - at exit: close the others regardless
            log.exception("closing a catalog shard host")


def child_pids(hosts: list[ShardHost]) -> list[int]:
    """The live hosts' process ids (diagnostics and tests)."""
    return [pid for host in hosts if (pid := host.pid) is not None and os.path.exists(f"/proc/{pid}")]
