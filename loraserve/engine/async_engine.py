"""The in-thread transport: the engine core on a thread of the API server's process.

`ThreadTransport` carries an `EngineClient`'s messages to an `EngineCore` (`core.engine_core`)
that runs on its own thread: the messages (`engine.messages` records, not encoded) travel to it on
one queue, its deltas and call returns come back to the event loop with `call_soon_threadsafe`,
and everything the HTTP side reads about the engine comes from the `EngineSnapshot` it
publishes. `AsyncEngine` is the client over it: the single-process hosting (tests, debugging,
`loraserve serve --single-process`); `CoreClient` runs the same core in its own process.

Its loop stamps PROGRESS as the core process's does (`EngineCore.run`), and `ready` reads it
(ALIVE is this very process, always alive while it answers): an engine thread stuck in one turn for
`engine_timeout_s` is not ready (/ready 503), as a stalled core is not, and a watch on the event
loop (`_watch`) ends the requests and calls in flight then with one clean 503 each, as the
process hosting's supervisor does when it replaces a stalled core (a thread cannot be killed:
once it moves again, its deltas for them are dropped and their aborts free what they hold).
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time

from .client.frontend import EngineClient, Transport, unavailable_error
from .config import EngineConfig
from .core.build import build_engine
from .core.engine_core import EngineCore
from .core.llm_engine import LLMEngine
from .heartbeat import ENGINE_TIMEOUT_S, HEARTBEAT_S, LOOP_WAITING, Heartbeat
from .messages import Message, Stop
from .snapshot import EngineSnapshot
from .types import EngineError

log = logging.getLogger(__name__)
_WAKE = object()  # on the queue: run a turn (a page-in landed, a grammar compiled, ...)


class ThreadTransport(Transport):
    def __init__(self, engine: LLMEngine, engine_timeout_s: float = ENGINE_TIMEOUT_S):
        self.engine, self.cfg, self.directory = engine, engine.cfg, engine.directory
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.core = EngineCore(engine, lambda: self._inbox.put(_WAKE),  # engine thread only
                               lambda: not self._inbox.empty())
        self._thread: threading.Thread | None = None
        self._watcher: asyncio.Task | None = None
        self.heartbeat = [math.inf, LOOP_WAITING]  # ALIVE: this process; PROGRESS: the loop's
        self._progress = Heartbeat(self.heartbeat, HEARTBEAT_S, engine_timeout_s)

    # -- what the server reads -------------------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot

    @property
    def ready(self) -> bool:
        """The engine thread makes progress: not stuck in one turn for the engine timeout."""
        return self._progress.stalled_for(time.monotonic()) <= self._progress.timeout_s

    def unavailable(self) -> EngineError:
        stuck = self._progress.stalled_for(time.monotonic())
        if stuck <= self._progress.timeout_s:
            return super().unavailable()
        return unavailable_error(f"the engine has made no progress for {stuck:.1f} s; retry later")

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.core.running = True  # (again, after a shutdown)
        self._thread = threading.Thread(target=self.core.run, name="loraserve-engine", daemon=True,
                                        args=(self._take, self._hand_over, self.heartbeat))
        self._thread.start()
        self._watcher = asyncio.ensure_future(self._watch())

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._watcher.cancel()
        self.send(Stop())
        await asyncio.to_thread(self._thread.join, 10)
        self._thread = None
        self.core.close()

    async def _watch(self) -> None:
        """Event loop, every half beat: at the start of each stall (above), what is in flight ends."""
        stalled = False
        while True:
            await asyncio.sleep(self._progress.suspect_s / 2)
            stuck = self._progress.stalled_for(time.monotonic())
            if stuck > self._progress.timeout_s and not stalled:
                err = unavailable_error(f"the engine made no progress for {stuck:.1f} s while "
                                        "serving this request; retry it")
                log.error("engine thread stalled for %.1f s: ending what is in flight", stuck)
                self.client._fail_all(err)  # (their aborts free what they hold once the thread moves again)
            stalled = stuck > self._progress.timeout_s

    # -- the messages ---------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        self._inbox.put(msg)

    def _take(self, wait_s: float | None) -> list[Message]:
        """The messages queued now; with none, wait for one at most `wait_s` (None: until one
        comes; a wake-up counts)."""
        messages: list[Message] = []
        try:
            item = self._inbox.get_nowait() if wait_s == 0 else self._inbox.get(timeout=wait_s)
            while True:
                if item is not _WAKE:
                    messages.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return messages

    def _hand_over(self, outs: list, replies: list) -> None:
        if outs:
            self._loop.call_soon_threadsafe(self.client._deliver, outs)
        for ret in replies:  # call returns (no Hello is sent here: no Ready comes back)
            self._loop.call_soon_threadsafe(self.client._returned, ret)


class AsyncEngine(EngineClient):
    """The `EngineClient` over a `ThreadTransport` around `engine` (its name kept for the many
    who build one: `serve --single-process`, tests, benches)."""

    def __init__(self, engine: LLMEngine, engine_timeout_s: float = ENGINE_TIMEOUT_S):
        super().__init__(ThreadTransport(engine, engine_timeout_s), engine.tokenizer)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        return cls(build_engine(cfg))

    @classmethod
    def from_model_dir(cls, model_dir: str, **kw) -> AsyncEngine:
        return cls.from_config(EngineConfig(model_dir=str(model_dir), **kw))
