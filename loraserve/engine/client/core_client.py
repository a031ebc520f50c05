"""The process transport: the API server's side of an engine-core process (`core.process`).

`ProcessTransport` carries an `EngineClient`'s messages to an engine-core process it starts, and
keeps the latest snapshot the core published (the client keeps the rest locally: the tokenizer,
the model's sizes, the catalog); `CoreClient` is the client over it, as `loraserve serve` and
each Ray Serve replica host it. The core gets one end of a Unix socket pair; this end is an
asyncio transport on the server's event loop (no I/O thread in between: see `core.process`),
and the messages one turn of the loop queues (requests, aborts, calls) leave as one write at the
end of that turn, so under load one write carries many requests.

A supervisor task on the event loop owns the core's life (`_supervise`). It starts a core,
waits for its handshake (at most `start_timeout_s`; a core whose beat stops for
`engine_timeout_s` while it starts is given up sooner), then watches two things until the core
is lost: the process's sentinel (it died) and its heartbeat (`heartbeat`: two timestamps the core
writes into shared memory, ALIVE from a beat thread, PROGRESS from its loop). A core whose ALIVE
is a few beats old is not `ready` (/ready 503, new requests 503 with Retry-After); one that shows
no progress for `engine_timeout_s` (its loop stuck in one turn, or the process stopped) is
stalled. Either loss ends every request in flight with one clean 503 (a streamed response gets
its error event; nothing is torn), kills the process if it still runs (SIGKILL: a stopped
process too), reaps it (no zombie) and starts a new core after a backoff (`Backoff`: 0.5 s
doubling to 30 s, back to 0.5 s after a core that was up for a minute), whether requests arrive
or not. While no core is up, requests get a 503 at once.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import socket
import time

from ...adapters.limits import PoolLimits
from ..config import EngineConfig
from ..core.boot import boot_core
from .frontend import RETRY_AFTER_MAX_S, EngineClient, Transport, unavailable_error
from ..heartbeat import ENGINE_TIMEOUT_S, HEARTBEAT_S, Heartbeat, heartbeat_slots
from ..snapshot import EngineSnapshot
from ..messages import (Abort, Batch, CoreInfo, Hello, Malformed, Message, Ready, Return, Step, Stop,
                        decode_batch, encode)
from ..types import EngineError
from ..wire import unpacker

log = logging.getLogger(__name__)


class Backoff:
    """The waits between core starts: `initial`, doubling up to `cap`; back to `initial` after
    a core that was up (serving) for at least `healthy_s`."""

    def __init__(self, initial: float = 0.5, cap: float = 30.0, healthy_s: float = 60.0):
        if not 0 < initial <= cap:
            raise ValueError("backoff needs 0 < initial <= cap")
        self.initial, self.cap, self.healthy_s = initial, cap, healthy_s
        self.delay = initial  # the next wait

    def next(self, up_for: float) -> float:
        """The wait before the next start, after a core that was up for `up_for` seconds (0: it
        never came up)."""
        if up_for >= self.healthy_s:
            self.delay = self.initial
        wait, self.delay = self.delay, min(self.cap, self.delay * 2)
        return wait


# How long a new core may take to be ready (the default `start_timeout_s`): longer where it may
# compile its decode step (`--compile on|auto`), which took 2.5-4 minutes at 0.6B shapes on 2
# cores, and up to 22 on a loaded machine (bench/RESULTS.md). A core that stops beating is
# caught by the engine timeout whatever this is.
START_TIMEOUT_S = 300.0  # a core's start-up: loading the base, warming adapters
COMPILE_START_TIMEOUT_S = 1800.0  # ... and compiling its decode step (minutes on a small CPU)


class ProcessTransport(Transport, asyncio.Protocol):  # the protocol of its end of the core's socket
    snapshot = EngineSnapshot()  # the latest a core published (a Step that carries one)

    def __init__(self, cfg: EngineConfig, *, start_timeout_s: float | None = None,
                 engine_timeout_s: float = ENGINE_TIMEOUT_S, heartbeat_s: float | None = None,
                 backoff: Backoff | None = None):
        if engine_timeout_s <= 0:
            raise ValueError("engine_timeout_s must be > 0")
        self.cfg = cfg
        self.start_timeout_s = start_timeout_s if start_timeout_s is not None else \
            START_TIMEOUT_S if cfg.compile == "off" else COMPILE_START_TIMEOUT_S
        self.engine_timeout_s = engine_timeout_s
        self.heartbeat_s = heartbeat_s or min(HEARTBEAT_S, engine_timeout_s / 4)
        self.backoff = backoff or Backoff()
        # why each core was replaced: the restart counter's label
        self.restart_causes = dict.fromkeys(("exited", "stalled", "start_failed"), 0)
        self.state: str  # starting | up | down (a backoff before the next start) | stopped
        self._set_state("stopped")
        self.core_info: CoreInfo | None = None  # the current core's handshake
        # the current core
        self._proc: multiprocessing.Process | None = None
        self._conn: asyncio.Transport | None = None  # None: no core to write to
        self._outbox: list[Message] = []       # commands queued this loop turn (see send)
        self._frames = unpacker()  # what the core sent (`data_received`)
        self._beat: Heartbeat | None = None
        self._lost: asyncio.Future | None = None   # set when the core's process ends
        # the supervisor
        self._supervisor: asyncio.Task | None = None
        self._first_up: asyncio.Future | None = None  # the first core answered (or failed)
        self._stopping: asyncio.Future | None = None  # shutdown asked
        self._ever_up = False
        self._next_start_at = 0.0
        self._start_s = 10.0  # how long the last start took (what Retry-After adds for one)
        self._closing = False

    # -- what the server reads -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """A core is up, has answered its handshake and beats."""
        return self.state == "up" and self._beat.beating(time.monotonic())

    @property
    def core_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def supervision(self) -> dict:
        """The supervisor's state for /metrics (`server.engine_metrics`)."""
        now = time.monotonic()
        beat = self._beat if self.state == "up" else None
        return {"state": self.state, "up": int(self.ready), "restarts": dict(self.restart_causes),
                "heartbeat_age_s": None if beat is None else beat.silent_for(now),
                "stuck_s": None if beat is None else beat.stuck_for(now),
                "backoff_s": self.backoff.delay}

    def unavailable(self) -> EngineError:
        """The 503 for a request while no core takes requests, with a Retry-After estimate."""
        now = time.monotonic()
        if self._closing:
            return unavailable_error("the server is shutting down", RETRY_AFTER_MAX_S)
        if self.state == "up":  # up, but its beat is late
            beat = self._beat
            eta = (self.engine_timeout_s - beat.stalled_for(now)) + self.backoff.delay + self._start_s
            return unavailable_error(f"the engine core has not answered for {beat.silent_for(now):.1f} s; "
                                "retry later", eta)
        if self.state == "down":
            return unavailable_error("the engine core is restarting; retry later",
                                self._next_start_at - now + self._start_s)
        return unavailable_error("the engine core is starting; retry later",
                            self._start_s - (now - self._state_since))

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the supervisor (once) and wait until its first core is ready. Once a core has
        been up, a request that finds none ready gets a 503 at once (with Retry-After) instead
        of waiting: the supervisor starts the next one whether requests come or not."""
        if self.ready:
            return  # running: no await, which under load would cost a turn of the event loop
        if self._closing or self._ever_up:  # (a supervisor runs after a core was up)
            raise self.unavailable()
        if self._supervisor is None:
            self._loop = asyncio.get_running_loop()
            self._first_up = self._loop.create_future()
            # nobody may be waiting: no "exception was never retrieved"
            self._first_up.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._stopping = self._loop.create_future()
            self._supervisor = asyncio.ensure_future(self._supervise())
        await asyncio.shield(self._first_up)

    async def shutdown(self) -> None:
        self._closing = True
        supervisor = self._supervisor
        if supervisor is not None:
            if not self._stopping.done():
                self._stopping.set_result(None)
            await asyncio.gather(supervisor, return_exceptions=True)

    def _set_state(self, state: str) -> None:
        self.state, self._state_since = state, time.monotonic()

    async def _supervise(self) -> None:
        """The supervisor (above), until shutdown: the first core failing to come up ends it
        instead (start() reports it; the next start() tries again)."""
        try:
            while not self._closing:
                self._set_state("starting")
                proc, ended = None, ("failed", "start_failed")  # (cause, kind); None: shutdown
                try:
                    proc = await self._spawn()
                    ended = await self._watch(proc, self._state_since + self.start_timeout_s)
                except Exception as exc:  # e.g. no file descriptors left to spawn with
                    log.exception("starting the engine core failed")
                    ended = f"failed to start ({exc})", "start_failed"
                finally:
                    up_for = time.monotonic() - self._state_since if self.state == "up" else 0.0
                    await self._end_core(proc, None if ended is None else ended[0])
                if self._closing:  # (`_watch` returns None only then)
                    break
                cause, kind = ended
                if not self._ever_up:
                    raise unavailable_error(f"the engine core {cause} (see the server log)", self._start_s)
                self.restarts += 1
                self.restart_causes[kind] += 1
                delay = self.backoff.next(up_for)
                self._next_start_at = time.monotonic() + delay
                self._set_state("down")
                log.error("engine core %s; restart %d in %.2f s", cause, self.restarts, delay)
                await asyncio.wait((self._stopping,), timeout=delay)
        except EngineError as exc:  # the first core never came up
            self._first_up.set_exception(exc)
            self._supervisor = None
        finally:
            if not self._first_up.done():
                self._first_up.set_exception(unavailable_error("the server is shutting down",
                                                          RETRY_AFTER_MAX_S))
            if self._closing or self._supervisor is None:
                self._set_state("stopped")

    async def _watch(self, proc, deadline: float) -> tuple[str, str] | None:
        """Event loop, every half beat: while the core starts (until its handshake, `_up`), for
        its loss (it died, its beat stopped for the engine timeout, or `deadline` passed); while
        it is up, for its loss (it died, or its loop made no progress for the engine timeout).
        Returns (cause, kind) once it is lost; None at shutdown."""
        timeout = self.engine_timeout_s
        woke = watched = time.monotonic()
        while True:
            await asyncio.wait((self._lost, self._stopping), timeout=self.heartbeat_s / 2,
                               return_when=asyncio.FIRST_COMPLETED)
            # this watch itself did not run for half the timeout (the process stopped with the
            # core, a paused VM, a blocked loop): the core's beat is as old, through no fault of
            # its own. A core is judged only on what this watch saw: stalled for the timeout
            # since the watch resumed (`watched`), not for the pause. (Judging at the next wake
            # gave the resumed core half a beat, 50 ms, to end the turn it was stopped in; on a
            # busy machine it sometimes did not, and a live core was killed.)
            now = time.monotonic()
            if now - woke > timeout / 2:
                watched = now
            woke = now
            if self._stopping.done():
                return None
            if self.state == "up":
                if self._lost.done():
                    return f"{proc.pid} died", "exited"
                if (stalled := min(self._beat.stalled_for(now), now - watched)) > timeout:
                    return (f"{proc.pid} stalled (no progress for {stalled:.1f} s, engine timeout "
                            f"{timeout:g} s)", "stalled")
            elif self._lost.done():
                return f"{proc.pid} exited while starting", "start_failed"
            elif (silent := min(self._beat.silent_for(now), now - watched)) > timeout:
                return (f"{proc.pid} stalled while starting (no heartbeat for {silent:.1f} s, "
                        f"engine timeout {timeout:g} s)", "stalled")
            elif now > deadline:
                return f"{proc.pid} did not start within {self.start_timeout_s:g} s", "start_failed"

    def _up(self, info: CoreInfo) -> None:
        """Event loop: the new core answered its handshake (`info`, `data_received`): it is up."""
        self.core_info = info
        if self.client.catalog is not None:
            self.client.catalog.learn(info.base_fingerprint, PoolLimits(info.max_rank, info.kinds))
        self._start_s = time.monotonic() - self._state_since
        self._ever_up = True
        self._set_state("up")
        if not self._first_up.done():
            self._first_up.set_result(None)
        log.info("engine core %d ready", self._proc.pid)

    async def _spawn(self) -> multiprocessing.Process:
        """Start a core process on one end of a new socket pair, with new heartbeat slots, and
        send it the handshake; its messages are handled as they arrive (`data_received`)."""
        ctx = multiprocessing.get_context("spawn")
        slots = heartbeat_slots(ctx)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._frames = unpacker()
            self._conn, _ = await self._loop.create_unix_connection(lambda: self, sock=mine)
            proc = ctx.Process(target=boot_core, name="loraserve-core", daemon=True,
                               args=(self.cfg, theirs, os.getpid(), slots, self.heartbeat_s))
            proc.start()  # the child inherits `theirs`
        except BaseException:
            mine.close()
            self._close_conn()
            raise
        finally:
            theirs.close()
        self._proc = proc
        self._beat = Heartbeat(slots, self.heartbeat_s, self.engine_timeout_s)
        self._lost = self._loop.create_future()
        self._loop.add_reader(proc.sentinel, self._core_died, proc)
        self._write(Hello())
        return proc

    def _core_died(self, proc) -> None:
        """Event loop: the core process ended (its sentinel)."""
        self._loop.remove_reader(proc.sentinel)
        if proc is self._proc and not self._lost.done():
            self._lost.set_result(None)

    async def _end_core(self, proc, cause: str | None) -> None:
        """The current core is lost (`cause`) or shutting down (None): fail what is in flight
        with one clean 503 each, stop the process (gracefully at shutdown when it is up and
        beats; else SIGKILL, which ends a stopped process too) and reap it."""
        graceful = self.state == "up"
        self._set_state("stopped" if self._closing else "down")
        what = "stalled" if "stalled" in (cause or "") else "stopped"
        self.client._fail_all(self.unavailable() if cause is None else unavailable_error(  # (shutting down)
            f"the engine core {what} while serving this request; retry it",
            self.backoff.delay + self._start_s))
        if cause is None and graceful and self._conn is not None \
                and not self._conn.is_closing():  # (a core that hung up is not asked)
            await self._stop_gracefully(proc)
        self._close_conn()
        if proc is None:
            return
        self._loop.remove_reader(proc.sentinel)
        if proc.is_alive():
            if cause is not None:
                log.error("engine core %s: killing it", cause)
            proc.kill()
        await asyncio.to_thread(proc.join, 10)  # reaped: no zombie
        if proc.exitcode is not None:
            if cause is not None:
                log.error("engine core %d ended with exit code %s", proc.pid, proc.exitcode)
            proc.close()  # its sentinel's descriptor too: restarts leak none
        else:
            log.error("engine core %d did not end after SIGKILL", proc.pid)
        self._proc = None

    async def _stop_gracefully(self, proc, within_s: float = 10.0) -> None:
        """Ask the core to stop and wait for it to end, at most `within_s`, and only as long as
        it beats (a stopped core is not waited for: the caller kills it)."""
        self._flush()
        self._write(Stop())
        deadline = time.monotonic() + within_s
        while not self._lost.done() and time.monotonic() < deadline:
            if not self._beat.beating(time.monotonic()):
                log.error("engine core %d does not beat; killing it instead", proc.pid)
                return
            await asyncio.wait((self._lost,), timeout=self.heartbeat_s / 2)

    def _close_conn(self) -> None:
        """Close this end of the current core's socket; commands not sent are dropped (their
        requests and calls are failed by whoever closes it, or were never accepted)."""
        self._outbox.clear()
        if self._conn is not None:
            self._conn.abort()
        self._conn = None

    # -- messages -------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Event loop: bytes from the core; each message they complete handled in turn (a frame
        that does not decode is a `Malformed`: what it names fails, the rest goes on)."""
        self._frames.feed(data)
        for msg in (m for frame in self._frames for m in decode_batch(frame)):
            match msg:
                case Step():  # one engine step: this server's deltas, and the snapshot if sent
                    if msg.snapshot is not None:  # without its detail: the one we have
                        self.snapshot = msg.snapshot if msg.detail else msg.snapshot.with_detail_of(self.snapshot)
                    if msg.outputs:
                        self.client._deliver(list(msg.outputs))
                case Return():
                    self.client._returned(msg)
                case Ready() if self.state == "starting" and not self._closing:
                    self._up(msg.info)
                case Malformed():
                    log.error("%s", msg.error)
                    if msg.error.call_id is not None:
                        self.client._returned(Return(msg.error.call_id, None, msg.error))

    def send(self, msg: Message) -> None:
        """Event loop: queue a message for the core. What one turn of the loop queues leaves as
        one Batch (in order) when the turn ends: under load, many requests per send. While no
        core is up (or it was lost while the adapter was resolved) a request or call gets the
        503; an abort has nothing left to end (what was in flight failed with the core)."""
        if self.state != "up" or self._conn is None:
            if isinstance(msg, Abort):
                return
            raise self.unavailable()
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(msg)

    def _flush(self) -> None:
        """Event loop: send the queued commands as one message."""
        if not self._outbox or self._conn is None:
            return
        commands, self._outbox = self._outbox, []
        self._write(commands[0] if len(commands) == 1 else Batch(tuple(commands)))

    def _write(self, msg: Message) -> None:
        self._conn.write(encode(msg))  # buffered by the transport if the socket is full


class CoreClient(EngineClient):
    """The `EngineClient` over a `ProcessTransport` (its name kept for those who build one:
    `loraserve serve`, the Ray Serve replicas, tests); keywords as `ProcessTransport`'s."""

    def __init__(self, cfg: EngineConfig, **transport):
        super().__init__(ProcessTransport(cfg, **transport))
