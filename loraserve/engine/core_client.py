"""The API server's side of an engine-core process (`loraserve.engine.core`).

`CoreClient` is an `EngineFrontend`: the server uses it exactly as it uses `AsyncEngine`. It
starts the core process, speaks to it over a Unix socket pair (msgpack, see `wire`), and
keeps what the server reads locally: the tokenizer, the model's sizes, the catalog (listings,
imports, resolving a request's adapter) and the latest snapshot the core published. The core
sends token-id deltas; their text and stop strings are worked out here (`EngineFrontend`'s
`OutputProcessor`), and a request a stop string ends is aborted in the core.

The core gets one end of a Unix socket pair; this end is an asyncio transport on the server's
event loop (no I/O thread in between: see `core`), and the commands one turn of the loop queues
(requests, aborts, calls) leave as one message at the end of that turn, so under load one write
carries many requests.

If the core dies, every request in flight ends with one clean 503 error (a streamed response
gets its error event; nothing is torn), `ready` turns false, a new core is started, and
requests wait for it (up to `start_timeout_s`) instead of failing.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import socket

from loraserve.catalog.isolated import open_for_serving

from ..adapters.manager import describe_adapter, resolve_servable
from ..adapters.pool import PoolLimits
from ..adapters.stats import CacheStats, PagerStats, PoolStats
from ..model.config import ModelConfig
from ..tokenizer import Tokenizer
from .config import EngineConfig
from .core import run_core
from .frontend import EngineFrontend, resolve_with
from .snapshot import EngineSnapshot
from .types import EngineError, GenerateRequest
from .wire import (error_from_wire, output_from_wire, pack, request_to_wire, snapshot_from_wire,
                   unpacker)

log = logging.getLogger(__name__)


class RemoteAdapters:
    """What the server may use of the adapter tiers when they live in the core process: the
    catalog (opened here too: LMDB serves several processes), resolving and warming."""

    def __init__(self, client: CoreClient, catalog_dir: str):
        self.client = client
        self.catalog = open_for_serving(catalog_dir, readonly=False)  # shard hosts map the shards
        self.base_fingerprint = ""
        self.pool = PoolLimits(0, ())  # from the core's handshake

    def resolve(self, ref: str):
        return resolve_servable(self.catalog, self.base_fingerprint, self.pool, ref)

    def warm(self, ref: str) -> tuple[str, str]:
        """Blocking (a worker thread): resolve ref and have the core page it into its CPU tier."""
        rec = self.resolve(ref)
        self.client.call_from_thread("warm", [rec.to_json()])
        return rec.adapter_id, rec.revision

    def describe(self, adapter_id: str, residency) -> dict:
        return describe_adapter(self.catalog, adapter_id, residency)

    def close(self) -> None:
        self.catalog.close()


class _CoreConnection(asyncio.Protocol):
    """This process's end of the socket pair: every complete message to `on_message`."""

    def __init__(self, on_message):
        self.on_message = on_message
        self._messages = unpacker()

    def data_received(self, data: bytes) -> None:
        self._messages.feed(data)
        for msg in self._messages:
            self.on_message(msg)


class CoreClient(EngineFrontend):
    def __init__(self, cfg: EngineConfig, *, start_timeout_s: float = 300.0):
        mc = ModelConfig.from_dir(cfg.model_dir)  # first: an unsupported model says so in one line
        super().__init__(Tokenizer.from_dir(cfg.model_dir))
        self.cfg = cfg
        self.model_name = cfg.served_model_name or cfg.model_dir.rstrip("/").split("/")[-1]
        self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.adapter_manager = RemoteAdapters(self, cfg.catalog_dir) if cfg.catalog_dir else None
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._snapshot = EngineSnapshot()
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._transport: asyncio.Transport | None = None  # to the current core (None: no core)
        self._outbox: list[list] = []          # commands queued this loop turn (see _command)
        self._hello: asyncio.Future | None = None  # the current core's handshake answer
        self._serving = False                  # the current core has answered its handshake
        self._proc: multiprocessing.Process | None = None
        self._starting: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # -- what the server reads -------------------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def ready(self) -> bool:
        """A core is up and has answered its handshake."""
        return self._starting is not None and self._starting.done() and self._serving

    @property
    def core_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def residency(self, key: tuple[str, str]) -> str:
        return self.call_from_thread("residency", [[list(key)]])[0]

    def describe_adapter(self, adapter_id: str) -> dict:
        """Blocking (a worker thread): catalog reads here, residency from the core."""
        return self.adapter_manager.describe(adapter_id, self.residency)

    async def unload_adapter(self, adapter_id: str) -> int:
        await asyncio.to_thread(self.adapter_manager.catalog.policy, adapter_id)  # 404 first
        return await self.call("unload_adapter", [adapter_id])

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the core (once) and wait until one is ready."""
        if self._closing:
            raise EngineError("the server is shutting down", status=503, code="engine_unavailable")
        if self._starting is None:
            self._loop = asyncio.get_running_loop()
            self._starting = asyncio.ensure_future(self._launch())
        started = self._starting
        if started.done() and not started.cancelled() and started.exception() is None:
            return  # running: no await, which under load would cost a turn of the event loop
        try:
            await asyncio.wait_for(asyncio.shield(self._starting), self.start_timeout_s)
        except asyncio.TimeoutError:
            raise EngineError("the engine core is not ready yet; retry later", status=503,
                              code="engine_unavailable") from None
        except asyncio.CancelledError:
            if self._starting is not None and not self._starting.cancelled():
                raise  # the caller was cancelled, not the start
            self._starting = None  # the core died while starting: the next call tries again
            raise EngineError("the engine core failed to start (see the server log); retry",
                              status=503, code="engine_unavailable") from None

    async def shutdown(self) -> None:
        self._closing = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        await self._stop_core()
        if self.adapter_manager is not None:
            self.adapter_manager.close()

    async def _launch(self) -> None:
        """Start a core process on one end of a new socket pair, handshake on the other; from
        then on its messages are handled as they arrive (`_dispatch`)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._transport, _ = await self._loop.create_unix_connection(
                lambda: _CoreConnection(self._dispatch), sock=mine)
            proc = multiprocessing.get_context("spawn").Process(
                target=run_core, args=(self.cfg, theirs, os.getpid()), name="loraserve-core",
                daemon=True)
            proc.start()  # the child inherits `theirs`
        except BaseException:
            mine.close()
            self._close_transport()
            raise
        finally:
            theirs.close()
        self._proc = proc
        self._loop.add_reader(proc.sentinel, self._core_died, proc)
        self._hello = self._loop.create_future()
        self._send(["hello"])
        self._handshake(await self._hello)
        self._serving = True
        log.info("engine core %d ready", proc.pid)

    def _handshake(self, info: dict) -> None:
        mgr = self.adapter_manager
        if mgr is not None:
            mgr.base_fingerprint = info["base_fingerprint"]
            mgr.pool = PoolLimits(info["max_rank"], tuple(info["kinds"]))

    async def _stop_core(self) -> None:
        proc = self._proc
        if proc is not None:
            self._loop.remove_reader(proc.sentinel)
            if self._transport is not None and proc.is_alive():
                self._flush()
                self._send(["stop"])
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self._close_transport()
        self._proc = None

    def _close_transport(self) -> None:
        """Close this end of the current core's socket; commands not sent are dropped (their
        requests and calls are failed by whoever closes it, or were never accepted)."""
        self._serving = False
        self._outbox.clear()
        if self._transport is not None:
            self._transport.abort()
        self._transport = None

    def _core_died(self, proc) -> None:
        """Event loop: the core process ended unasked. Fail what was in flight, start another."""
        self._loop.remove_reader(proc.sentinel)
        if self._closing or proc is not self._proc:
            return
        log.error("engine core %d died (exit code %s); restarting it", proc.pid, proc.exitcode)
        self.restarts += 1
        err = EngineError("the engine core stopped while serving this request; retry it",
                          status=503, code="engine_unavailable")
        self._fail_in_flight(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self._close_transport()
        self._proc = None
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()  # it died before its handshake: let start() report that
            return
        self._starting = asyncio.ensure_future(self._launch())

    # -- messages -------------------------------------------------------------------------------
    def _dispatch(self, msg: list) -> None:
        """Event loop: one message from the core."""
        kind = msg[0]
        if kind == "step":  # one engine step: this server's deltas, and the snapshot if sent
            if msg[2] is not None:
                self._snapshot = snapshot_from_wire(msg[2], PoolStats, CacheStats, PagerStats)
            if msg[1]:
                self._deliver([output_from_wire(o) for o in msg[1]])
        elif kind == "ret":
            fut = self._calls.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[3] is None:
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(error_from_wire(msg[3]))
        elif kind == "ready":
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg[1])

    def _command(self, msg: list) -> None:
        """Event loop: queue a command for the core. What one turn of the loop queues leaves as
        one message (in order) when the turn ends: under load, many requests per send."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(msg)

    def _flush(self) -> None:
        """Event loop: send the queued commands as one ["batch", commands] message."""
        if not self._outbox or self._transport is None:
            return
        commands, self._outbox = self._outbox, []
        self._send(commands[0] if len(commands) == 1 else ["batch", commands])

    def _send(self, msg: list) -> None:
        self._transport.write(pack(msg))  # buffered by the transport if the socket is full

    async def call(self, name: str, args: list):
        """Run a named engine call in the core between steps; its result or error."""
        await self.start()
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self._command(["call", call_id, name, args])
        return await fut

    def call_from_thread(self, name: str, args: list, timeout: float = 120.0):
        """`call` from a worker thread (blocking)."""
        return asyncio.run_coroutine_threadsafe(self.call(name, args), self._loop).result(timeout)

    # -- EngineFrontend -------------------------------------------------------------------------
    def _resolve(self, ref: str):
        return resolve_with(self.adapter_manager, ref)

    def _submit(self, req: GenerateRequest, record) -> None:
        if self._transport is None:
            raise EngineError("the engine core is restarting; retry", status=503, code="engine_unavailable")
        self._command(["add", request_to_wire(req), None if record is None else record.to_json()])

    def _abort(self, request_id: str) -> None:
        if self._transport is not None:
            self._command(["abort", request_id])
