"""The engine core in its own process: scheduler, adapter tiers and model runner behind a socket.

The API server (`CoreClient`) starts the core with one end of a Unix socket pair and talks to it
with msgpack messages (`loraserve.engine.wire`): batches of requests, aborts and calls in; one
message per step out, carrying the step's token-id deltas and, when it changed, the engine
snapshot. The core's main thread owns the `LLMEngine` and runs the `EngineLoop` between polls of
the socket; pager threads wake it through a pipe when page-ins land. The HTTP event loop,
tokenization, detokenization and stop strings stay in the API server's process, so the two no
longer share one GIL, and a crash of the core is survivable: the API server answers what was in
flight with a clean error and starts a new core.

Crossings are few and cheap on purpose. A plain socket read and written by the two loops
themselves has no I/O thread in between (ZeroMQ, used before, woke an I/O thread on each side
per message: on 2 busy cores each wake-up could cost a scheduler slice, and `Socket.send` was
the API process's top frame; bench/RESULTS.md, the hot path). A step's outputs and the snapshot
travel together, and while the engine steps without a pause the snapshot goes out at most
every `SNAPSHOT_EVERY_S` (at once when the engine idles or an operator call returns, so what a
caller reads after a call or a finished request is current).

The core beats (`heartbeat`): a thread writes ALIVE every `heartbeat_s` from the moment the
process runs (`core_boot.boot_core`), and the loop writes PROGRESS at the start of each turn
(LOOP_WAITING while it blocks in poll). The API server's supervisor reads them: a stopped core
stops ALIVE, a loop stuck in a step stops PROGRESS while ALIVE goes on, and a long step that
runs stops neither for longer than it lasts.
"""
from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import time
from concurrent.futures import Future

from loraserve.catalog.records import RevisionRecord

from ...heap import settle_heap
from ...logs import configure_process_logging
from .build import build_engine
from ..config import EngineConfig
from .engine_loop import EngineLoop
from ..heartbeat import ALIVE, HEARTBEAT_S, LOOP_WAITING, PROGRESS, Beat
from .llm_engine import LLMEngine
from .training import close_trainer, trainer_of
from ..types import EngineError, GenerateRequest, RequestOutput
from ..wire import (error_to_wire, output_to_wire, pack, request_from_wire, snapshot_to_wire,
                   unpacker)

log = logging.getLogger(__name__)
_IDLE_POLL_MS = 1000    # idle: wake at least this often to check that the parent lives
_RECV_BYTES = 1 << 16
_WAITING_POLL_MS = 50   # queued work that could not run: look again this often
SNAPSHOT_EVERY_S = 0.02  # while stepping without a pause, publish the snapshot at most this often


def run_core(cfg: EngineConfig, conn: socket.socket, parent_pid: int, heartbeat=None,
             beat: Beat | None = None) -> None:
    """Build the engine, serve `conn` until the parent goes away (in the core process, started
    by `core_boot.boot_core`). `heartbeat`: the slots shared with the API server, `beat` the
    thread already beating into them."""
    configure_process_logging("core", logging.INFO, "%(asctime)s core %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when the core stops
    core = EngineCore(build_engine(cfg), conn, parent_pid, heartbeat, beat=beat)
    settle_heap()  # the engine is built: freeze its heap, collect less often (loraserve.heap)
    try:
        core.serve()
    finally:
        core.close()


class EngineCore:
    """Serves one API server over `conn` (a connected stream socket) until it says stop, closes
    the socket, or (with parent_pid) stops being this process's parent. With `heartbeat` (two
    writable float slots: ALIVE, PROGRESS) it beats into them until `close`: its loop writes
    PROGRESS, `beat` (a `heartbeat.Beat` already running; else one started here, every
    `heartbeat_s`) ALIVE."""

    def __init__(self, engine: LLMEngine, conn: socket.socket, parent_pid: int | None = None,
                 heartbeat=None, heartbeat_s: float = HEARTBEAT_S, beat: Beat | None = None):
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.parent_pid = parent_pid
        self.conn = conn
        conn.setblocking(False)
        self._messages = unpacker()
        self._unsent = bytearray()  # what the socket did not take yet (sent when writable)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()
        self._poll.register(conn, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        engine.set_notify(self._wake)
        self.returns: queue.SimpleQueue = queue.SimpleQueue()  # (call id, value, error)
        # requests whose grammar compiles on the grammar workers: admitted when it is done
        self._compiling: dict[str, tuple[GenerateRequest, bytes | None, Future, float]] = {}
        self._snapshot = None  # the last snapshot sent (None: send the next one whatever it is)
        self._snapshot_sent_at = float("-inf")
        self._running = True
        self.heartbeat = heartbeat if heartbeat is not None else [0.0, 0.0]  # (unread: no beats)
        self.heartbeat[PROGRESS] = self.heartbeat[ALIVE] = time.monotonic()
        if heartbeat is not None and beat is None:
            beat = Beat(heartbeat, heartbeat_s)
        self._beat = beat

    def _wake(self) -> None:
        """Any thread: make the next poll return."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass
        except OSError:  # closed: a compile that ended after the core stopped has no one to wake
            pass

    # -- the loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        beat = self.heartbeat
        while self._running and self._parent_alive():
            timeout = 0 if self.loop.busy else (_WAITING_POLL_MS if self.engine.scheduler.has_work
                                                else _IDLE_POLL_MS)
            if timeout:  # waiting for a command or a page-in is not being stuck
                beat[PROGRESS] = LOOP_WAITING
                ready = self._poll.poll(timeout)
                beat[PROGRESS] = time.monotonic()
            else:  # busy: this turn started now (the last one's step is done)
                beat[PROGRESS] = time.monotonic()
                ready = self._poll.poll(0)
            for fd, events in ready:
                if fd == self._wake_r:
                    self._drain_wakes()
                elif events & select.POLLOUT:
                    self._write(b"")
            outs: list[RequestOutput] = []
            for msg in self._receive():
                outs.extend(self._handle(msg))
            if self._compiling:
                outs.extend(self._admit_compiled())
            outs.extend(self.loop.serve())
            self._send_step(outs)  # before the slice: a token never waits for it
            self._send_returns()
            if self.loop.train():
                self._send_returns()  # passes that ended in the slice

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _receive(self) -> list[list]:
        """The messages the socket holds now (none when it is empty); its end stops serving."""
        while True:
            try:
                data = self.conn.recv(_RECV_BYTES)
            except BlockingIOError:
                break
            except ConnectionError:
                data = b""
            if not data:  # the API server closed its end: nobody to serve
                self._running = False
                break
            self._messages.feed(data)
        return list(self._messages)

    def close(self) -> None:
        if self._beat is not None:
            self._beat.stop()
        close_trainer(self.engine)
        if (compiler := getattr(self.engine, "compiler", None)) is not None:
            compiler.close()  # stops after the bucket in hand
        if self.engine.adapters is not None:
            self.engine.adapters.close()
        self.conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- messages in ----------------------------------------------------------------------------
    def _handle(self, msg: list) -> list[RequestOutput]:
        kind = msg[0]
        if kind == "batch":  # the commands one turn of the API server's event loop queued, in order
            outs: list[RequestOutput] = []
            for command in msg[1]:
                outs.extend(self._handle(command))
            return outs
        if kind == "hello":
            self._send(["ready", self._info()])
            self._snapshot = None  # the next snapshot goes out whatever it is
        elif kind == "add":
            return self._add(msg[1], msg[2])
        elif kind == "abort":
            if self._compiling.pop(msg[1], None) is None:
                self.loop.abort(msg[1])
        elif kind == "call":
            self._call(msg[1], msg[2], msg[3])
        elif kind == "stop":
            self._running = False
        return []

    def _add(self, wire_req: dict, record_json: bytes | None) -> list[RequestOutput]:
        req = request_from_wire(wire_req)
        spec = req.params.structured
        if spec is not None:
            compiled = self.engine.grammars.prepare(spec)
            if not compiled.done():  # admitted once compiled: a step never waits for a compile
                self._compiling[req.request_id] = (req, record_json, compiled, time.monotonic())
                compiled.add_done_callback(lambda _: self._wake())
                return []
        return self._admit(req, record_json)

    def _admit(self, req: GenerateRequest, record_json: bytes | None) -> list[RequestOutput]:
        record = RevisionRecord.from_json(record_json) if record_json is not None else None
        try:  # a grammar that does not compile (structured output): that request alone fails
            seq = self.engine.make_sequence(req, record)
        except EngineError as exc:
            return [RequestOutput.failed(req.request_id, exc, len(req.prompt_token_ids))]
        return self.loop.add(seq, req.stream)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Admit the requests whose grammar is now compiled; fail those whose grammar did not
        compile, or not within the grammar engine's timeout (400s naming the field)."""
        outs: list[RequestOutput] = []
        grammars = self.engine.grammars
        for request_id, (req, record_json, compiled, since) in list(self._compiling.items()):
            if not compiled.done() and not grammars.late(since):
                continue
            del self._compiling[request_id]
            error = compiled.exception() if compiled.done() else \
                grammars.timeout_error(req.params.structured)
            if error is None:
                outs.extend(self._admit(req, record_json))
            else:
                outs.append(RequestOutput.failed(request_id, error, len(req.prompt_token_ids)))
        return outs

    def _info(self) -> dict:
        mgr = self.engine.adapters
        return {"pid": os.getpid(), "model_name": self.engine.model_name,
                "max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "base_fingerprint": mgr.base_fingerprint if mgr is not None else None,
                "max_rank": mgr.pool.limits.max_rank if mgr is not None else 0,
                "kinds": list(mgr.pool.limits.kinds) if mgr is not None else []}

    # -- calls: operator commands ---------------------------------------------------------------
    def _call(self, call_id: int, name: str, args: list) -> None:
        mgr = self.engine.adapters
        try:
            if name == "unload_adapter":
                self._return(call_id, self.engine.unload_adapter(args[0]))
            elif name == "train":  # a training operation (engine/training.py), between steps
                value = trainer_of(self.engine).handle(args[0], args[1])
                if isinstance(value, Future):  # a queued pass: answered after its last slice
                    value.add_done_callback(lambda f: self.returns.put(
                        (call_id, None if f.exception() else f.result(), f.exception())))
                else:
                    self._return(call_id, value)
            elif name == "residency":
                self._return(call_id, [self._residency(tuple(k)) for k in args[0]])
            elif name == "warm":  # page into the CPU tier without blocking the loop
                rec = RevisionRecord.from_json(args[0])
                fut = mgr.pager.fetch(rec)
                fut.add_done_callback(lambda f: self._finish_warm(call_id, f))
            else:
                raise ValueError(f"unknown engine call {name!r}")
        except Exception as exc:
            self.returns.put((call_id, None, exc))

    def _finish_warm(self, call_id: int, fut) -> None:
        """Pager thread."""
        self.returns.put((call_id, None, fut.exception()))
        self._wake()

    def _return(self, call_id: int, value) -> None:
        self.returns.put((call_id, value, None))

    def _residency(self, key: tuple[str, str]) -> str:
        mgr = self.engine.adapters
        if mgr is not None and key in mgr.quarantined:
            return "quarantined"
        if mgr is not None and key in mgr.pool:
            return "gpu"
        return "cpu" if mgr is not None and key in mgr.cpu_cache else "disk"

    # -- messages out ---------------------------------------------------------------------------
    def _send(self, msg: list) -> None:
        self._write(pack(msg))

    def _write(self, data: bytes) -> None:
        """Send data after anything still unsent; what the socket does not take now waits for it
        to be writable (the poll then watches for that)."""
        waited = bool(self._unsent)
        if waited:
            self._unsent += data
            data, self._unsent = bytes(self._unsent), bytearray()
        if not data:
            return
        try:
            sent = self.conn.send(data)
        except BlockingIOError:
            sent = 0
        except ConnectionError:  # the API server is gone: nobody to serve
            self._running = False
            return
        self._unsent += data[sent:]
        if bool(self._unsent) != waited:
            self._poll.modify(self.conn, select.POLLIN | (select.POLLOUT if self._unsent else 0))

    def _send_step(self, outs: list[RequestOutput]) -> None:
        """One ["step", deltas, snapshot | None] message, when there are deltas or the snapshot
        is due (`_due_snapshot`)."""
        snap = self._due_snapshot()
        if outs or snap is not None:
            self._send(["step", [output_to_wire(out) for out in outs], snap])

    def _due_snapshot(self) -> dict | None:
        """The engine's snapshot in wire form if it changed since the last one sent and is due:
        at once when the engine idles or a call's return is about to go out (it follows this
        message, so the caller then reads a snapshot taken after its call), else when the last
        one is SNAPSHOT_EVERY_S old; None otherwise."""
        snap = self.engine.snapshot
        if snap is self._snapshot:
            return None
        now = time.monotonic()
        if (self.loop.busy and self.returns.empty()
                and now - self._snapshot_sent_at < SNAPSHOT_EVERY_S):
            return None
        self._snapshot, self._snapshot_sent_at = snap, now
        return snapshot_to_wire(snap)

    def _send_returns(self) -> None:
        while True:
            try:
                call_id, value, err = self.returns.get_nowait()
            except queue.Empty:
                return
            self._send(["ret", call_id, value, None if err is None else error_to_wire(err)])
