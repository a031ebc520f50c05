"""The engine core in its own process: scheduler, adapter tiers and model runner behind ZeroMQ.

API servers (`CoreClient`, one or several) talk to the core over one ROUTER socket with msgpack
messages (`loraserve.engine.wire`): batches of requests, aborts and calls in; one message per
step out to each client, carrying that client's token-id deltas and, when it changed, the
engine snapshot. The core's main thread owns the `LLMEngine` and runs the `EngineLoop` between
polls of the socket; pager threads wake it through a pipe when page-ins land. The HTTP event
loop, tokenization, detokenization and stop strings stay in the API server's process, so the two
no longer share one GIL, and a crash of the core is survivable: the API server answers what was
in flight with a clean error and starts a new core.

Messages are few on purpose: every ZeroMQ send wakes the I/O threads of both processes, which on
a small, busy machine costs more than building the message (bench/RESULTS.md, the hot path).
So a step's outputs and the snapshot travel together, and while the engine steps without a
pause the snapshot goes out at most every `SNAPSHOT_EVERY_S` (it goes out at once when the engine
idles or an operator call returns, so what a caller reads after a call or a finished request is
current).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import time

import zmq

from loraserve.catalog.records import RevisionRecord

from .build import build_engine
from .config import EngineConfig
from .engine_loop import EngineLoop
from .llm_engine import LLMEngine
from .types import RequestOutput
from .wire import error_to_wire, output_to_wire, pack, request_from_wire, snapshot_to_wire, unpack

log = logging.getLogger(__name__)
_IDLE_POLL_MS = 1000    # idle: wake at least this often to check that the parent lives
_WAITING_POLL_MS = 50   # queued work that could not run: look again this often
SNAPSHOT_EVERY_S = 0.02  # while stepping without a pause, publish the snapshot at most this often


def run_core(cfg: EngineConfig, address: str, parent_pid: int) -> None:
    """Process entry point: build the engine, serve `address` until the parent goes away."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when the core stops
    core = EngineCore(build_engine(cfg), address, parent_pid)
    try:
        core.serve()
    finally:
        core.close()


class EngineCore:
    def __init__(self, engine: LLMEngine, address: str, parent_pid: int | None = None):
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        engine.set_notify(self._wake)
        self.clients: set[bytes] = set()
        self.owner: dict[str, bytes] = {}  # request id -> the client that sent it
        self.returns: queue.SimpleQueue = queue.SimpleQueue()  # (client, call id, value, error)
        self._snapshot = None  # the last snapshot sent (None: send the next one whatever it is)
        self._snapshot_sent_at = float("-inf")
        self._running = True

    def _wake(self) -> None:
        """Any thread: make the next poll return."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    # -- the loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while self._running and self._parent_alive():
            timeout = 0 if self.loop.busy else (_WAITING_POLL_MS if self.engine.scheduler.has_work
                                                else _IDLE_POLL_MS)
            events = dict(poller.poll(timeout))
            if self._wake_r in events:
                self._drain_wakes()
            outs: list[RequestOutput] = []
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                outs.extend(self._handle(frames[0], unpack(frames[-1])))
            outs.extend(self.loop.step())
            self._send_step(outs)
            self._send_returns()

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.engine.adapters is not None:
            self.engine.adapters.close()
        self.sock.close(0)
        self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- messages in ----------------------------------------------------------------------------
    def _handle(self, client: bytes, msg: list) -> list[RequestOutput]:
        kind = msg[0]
        if kind == "batch":  # the commands one event-loop turn of an API server queued, in order
            outs: list[RequestOutput] = []
            for command in msg[1]:
                outs.extend(self._handle(client, command))
            return outs
        if kind == "hello":
            self.clients.add(client)
            self._send(client, ["ready", self._info()])
            self._snapshot = None  # the newcomer gets the next snapshot too
        elif kind == "add":
            return self._add(client, msg[1], msg[2])
        elif kind == "abort":
            self.owner.pop(msg[1], None)
            self.loop.abort(msg[1])
        elif kind == "call":
            self._call(client, msg[1], msg[2], msg[3])
        elif kind == "stop":
            self._running = False
        return []

    def _add(self, client: bytes, wire_req: dict, record_json: bytes | None) -> list[RequestOutput]:
        req = request_from_wire(wire_req)
        record = RevisionRecord.from_json(record_json) if record_json is not None else None
        seq = self.engine.make_sequence(req, record)
        self.owner[req.request_id] = client
        return self.loop.add(seq, req.stream)

    def _info(self) -> dict:
        mgr = self.engine.adapters
        return {"pid": os.getpid(), "model_name": self.engine.model_name,
                "max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "base_fingerprint": mgr.base_fingerprint if mgr is not None else None,
                "max_rank": mgr.pool.limits.max_rank if mgr is not None else 0,
                "kinds": list(mgr.pool.limits.kinds) if mgr is not None else []}

    # -- calls: operator commands ---------------------------------------------------------------
    def _call(self, client: bytes, call_id: int, name: str, args: list) -> None:
        mgr = self.engine.adapters
        try:
            if name == "unload_adapter":
                self._return(client, call_id, self.engine.unload_adapter(args[0]))
            elif name == "residency":
                self._return(client, call_id, [self._residency(tuple(k)) for k in args[0]])
            elif name == "warm":  # page into the CPU tier without blocking the loop
                rec = RevisionRecord.from_json(args[0])
                fut = mgr.pager.fetch(rec)
                fut.add_done_callback(lambda f: self._finish_warm(client, call_id, f))
            else:
                raise ValueError(f"unknown engine call {name!r}")
        except Exception as exc:
            self.returns.put((client, call_id, None, exc))

    def _finish_warm(self, client: bytes, call_id: int, fut) -> None:
        """Pager thread."""
        self.returns.put((client, call_id, None, fut.exception()))
        self._wake()

    def _return(self, client: bytes, call_id: int, value) -> None:
        self.returns.put((client, call_id, value, None))

    def _residency(self, key: tuple[str, str]) -> str:
        mgr = self.engine.adapters
        if mgr is not None and key in mgr.pool:
            return "gpu"
        return "cpu" if mgr is not None and key in mgr.cpu_cache else "disk"

    # -- messages out ---------------------------------------------------------------------------
    def _send(self, client: bytes, msg: list) -> None:
        self.sock.send_multipart([client, pack(msg)])

    def _send_step(self, outs: list[RequestOutput]) -> None:
        """One ["step", deltas, snapshot | None] message per client that has deltas, or to every
        client when the snapshot is due (`_due_snapshot`)."""
        by_client: dict[bytes, list] = {}
        for out in outs:
            last = out.finish_reason is not None or out.error is not None
            client = self.owner.pop(out.request_id, None) if last else self.owner.get(out.request_id)
            if client is not None:
                by_client.setdefault(client, []).append(output_to_wire(out))
        snap = self._due_snapshot()
        if snap is None:
            for client, wire_outs in by_client.items():
                self._send(client, ["step", wire_outs, None])
            return
        for client in self.clients | by_client.keys():
            self._send(client, ["step", by_client.get(client, []), snap])

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
                client, call_id, value, err = self.returns.get_nowait()
            except queue.Empty:
                return
            self._send(client, ["ret", call_id, value, None if err is None else error_to_wire(err)])
