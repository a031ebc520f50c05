"""The engine core in its own process: scheduler, adapter tiers and model runner behind a socket.

`EngineCoreProc` is the process transport's core side, over the transport-free `EngineCore`
(`core.engine_core`). The API server (`client.core_client.ProcessTransport`) starts the process
with one end of a Unix socket pair and talks to it in `engine.messages` records, msgpack-encoded: batches of requests,
aborts and calls in; one Step per engine step out, carrying the step's token-id deltas and,
when it changed, the engine snapshot. The process's main thread runs the core's turns between
polls of the socket; other threads (pager, grammar workers, training) wake it through a pipe.
The HTTP event loop, tokenization, detokenization and stop strings stay in the API server's
process, so the two no longer share one GIL, and a crash of the core is survivable: the API
server answers what was in flight with a clean error and starts a new core.

Crossings are few and cheap on purpose. A plain socket read and written by the two loops
themselves has no I/O thread in between (ZeroMQ, used before, woke an I/O thread on each side
per message: on 2 busy cores each wake-up could cost a scheduler slice, and `Socket.send` was
the API process's top frame; bench/RESULTS.md, the hot path). A step's outputs and the snapshot
travel together, and while the engine steps without a pause the snapshot goes out at most
every `SNAPSHOT_EVERY_S` (at once when the engine idles or an operator call returns, so what a
caller reads after a call or a finished request is current).

The core beats (`heartbeat` says what the API server reads in each slot): ALIVE from a thread
started as the process boots (`core.boot`), PROGRESS from the loop at the start of each turn
(LOOP_WAITING while it blocks in poll).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import signal
import socket
import time

from ...heap import settle_heap
from ...logs import configure_process_logging
from .build import build_engine
from ..config import EngineConfig
from .engine_core import EngineCore
from ..heartbeat import PROGRESS, Beat
from .llm_engine import LLMEngine
from ..messages import Malformed, Message, Ready, Return, Step, decode_batch, encode
from ..types import RequestOutput
from ..wire import unpacker

log = logging.getLogger(__name__)
_IDLE_POLL_MS = 1000    # idle: wake at least this often to check that the parent lives
_RECV_BYTES = 1 << 16
SNAPSHOT_EVERY_S = 0.02  # while stepping without a pause, publish the snapshot at most this often


def run_core(cfg: EngineConfig, conn: socket.socket, parent_pid: int, beat: Beat) -> None:
    """Build the engine, serve `conn` until the parent goes away (in the core process, started
    by `core_boot.boot_core`); `beat`: the thread already beating into the slots shared with the
    API server."""
    configure_process_logging("core", logging.INFO, "%(asctime)s core %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when the core stops
    proc = EngineCoreProc(build_engine(cfg), conn, parent_pid, beat)
    settle_heap()  # the engine is built: freeze its heap, collect less often (loraserve.heap)
    try:
        proc.serve()
    finally:
        proc.close()


class EngineCoreProc:
    """Serves one API server over `conn` (a connected stream socket) until it says stop, closes
    the socket, or (with parent_pid) stops being this process's parent. With `beat` (a
    `heartbeat.Beat` writing ALIVE into its slots, stopped by `close`) its loop writes PROGRESS
    into the same slots."""

    def __init__(self, engine: LLMEngine, conn: socket.socket, parent_pid: int | None = None,
                 beat: Beat | None = None):
        self.core = EngineCore(engine, self._wake, self._has_input)
        self.parent_pid = parent_pid
        self.conn = conn
        conn.setblocking(False)
        self._frames = unpacker()
        # what the socket did not take yet, in order, as views of the encoded messages (sent when
        # writable; never copied: a revision's blob is tens of MB and a slow reader takes a
        # socket buffer a turn)
        self._unsent: collections.deque[memoryview] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()
        self._poll.register(conn, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._snapshot = None  # the last snapshot sent (None: send the next one whatever it is)
        self._snapshot_sent_at = float("-inf")
        self._open = True  # the socket's peer is there
        self._beat = beat
        self.heartbeat = beat.slots if beat is not None else [0.0, 0.0]  # (unread: no beats)
        self.heartbeat[PROGRESS] = time.monotonic()

    def _wake(self) -> None:
        """Any thread: make the next poll return."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full: a wake-up is pending anyway; closed: the core stopped, none to wake
            pass

    def _has_input(self) -> bool:
        """Any thread while the loop waits in a turn (a training slice asks): a frame, a hang-up
        or a wake-up waits, or output waits and the socket can take some now (the poll watches
        for that only while something is unsent). Without the last, what a turn could not send
        (a save's 20 MB blob, and every delta queued behind it) went out one socket buffer per
        training slice: a stream stalled 5 s while slices of nothing but training ran."""
        ready = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLOUT
        return any(events & ready for _, events in self._poll.poll(0))

    # -- the loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        # while the API server is there: the socket is open and (with parent_pid) it is the parent
        self.core.run(self._take, self._send_replies, self.heartbeat, lambda: self._open and (
            self.parent_pid is None or os.getppid() == self.parent_pid))

    def _take(self, wait_s: float | None) -> list[Message | Malformed]:
        """Poll the socket and the wake pipe (at most `wait_s`; None: a second, to check on the
        parent), send what waited for the socket to be writable, and receive."""
        for fd, events in self._poll.poll(_IDLE_POLL_MS if wait_s is None else wait_s * 1000):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            elif events & select.POLLOUT:
                self._write(b"")
        return self._receive()

    def _receive(self) -> list[Message | Malformed]:
        """The messages the socket holds now (none when it is empty; a frame that does not
        decode is a `Malformed` in its place); its end stops serving."""
        while True:
            try:
                data = self.conn.recv(_RECV_BYTES)
            except BlockingIOError:
                break
            except ConnectionError:
                data = b""
            if not data:  # the API server closed its end: nobody to serve
                self._open = False
                break
            self._frames.feed(data)
        messages: list[Message | Malformed] = []
        try:
            for frame in self._frames:
                messages.extend(decode_batch(frame))
        except ValueError as exc:  # bytes that are not msgpack: the stream cannot be read on
            log.error("unreadable bytes from the API server (%s): closing", exc)
            self._open = False
        return messages

    def close(self) -> None:
        if self._beat is not None:
            self._beat.stop()
        self.core.close()
        self.conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- messages out ---------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        """Send data after anything still unsent, as much as the socket takes now; the rest waits
        for it to be writable (the poll then watches for that). Nothing queued is copied: the
        old buffer (joined and re-sliced each turn) cost a copy of everything queued per turn,
        and eight 20 MB saves queued behind a slow reader held every stream for 10-20 s."""
        waited = bool(self._unsent)
        if data:
            self._unsent.append(memoryview(data))
        while self._unsent:
            head = self._unsent[0]
            try:
                sent = self.conn.send(head)
            except BlockingIOError:
                break
            except ConnectionError:  # the API server is gone: nobody to serve
                self._open = False
                self._unsent.clear()
                return
            if sent < len(head):
                self._unsent[0] = head[sent:]
                break
            self._unsent.popleft()
        if bool(self._unsent) != waited:
            self._poll.modify(self.conn, select.POLLIN | (select.POLLOUT if self._unsent else 0))

    def _send_replies(self, outs: list[RequestOutput], replies: list[Ready | Return]) -> None:
        """One Step, when there are deltas or the snapshot is due, then the core's replies (call
        returns, the handshake's Ready). The engine's snapshot is due when it changed since the
        last one sent (a new peer gets the next one whatever it is), at once when the engine
        idles or a reply is about to go out (it follows this message, so a caller reads a
        snapshot taken after its call), else when the last one sent is SNAPSHOT_EVERY_S old."""
        if any(isinstance(r, Ready) for r in replies):
            self._snapshot = None  # a new peer
        snap, now, detail = self.core.engine.snapshot, time.monotonic(), True
        if snap is self._snapshot or (self.core.busy and not replies
                                      and now - self._snapshot_sent_at < SNAPSHOT_EVERY_S):
            snap = None  # unchanged, or not due yet
        else:  # the detail only when the engine read it again since the last one sent
            detail = self._snapshot is None or snap.detail_at != self._snapshot.detail_at
            self._snapshot, self._snapshot_sent_at = snap, now
        if outs or snap is not None:
            self._write(encode(Step(tuple(outs), snap, detail)))
        for reply in replies:
            self._write(encode(reply))
