"""The engine in the API server's process: it steps on its own thread behind asyncio.

Everything that changes engine state (a new request, an abort, an adapter unload) travels to
the engine thread as a command on one queue; everything the HTTP side reads about the engine
comes from the `EngineSnapshot` it publishes. This is the single-process hosting (tests,
debugging, `loraserve serve --single-process`); `CoreClient` runs the same engine in its own
process.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from .core.build import build_engine
from .config import EngineConfig
from .core.engine_loop import EngineLoop
from .client.frontend import EngineFrontend
from .client.sourcing import Sourcing
from .core.llm_engine import LLMEngine
from .core.training import close_trainer, trainer_of
from .snapshot import EngineSnapshot
from .training import Trainer
from .types import GenerateRequest, RequestOutput

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05  # with queued work that cannot run yet, look again this often


class AsyncEngine(EngineFrontend):
    def __init__(self, engine: LLMEngine):
        super().__init__(engine.tokenizer)
        self.engine = engine
        self.cfg = engine.cfg
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.directory = engine.directory  # the engine's catalog, in this process
        self.sourcing = Sourcing.open(engine.cfg, engine.adapters, self.directory)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_state = EngineLoop(engine)  # engine thread only
        self._compiling: set[str] = set()  # engine thread only: requests waiting on a grammar
        engine.set_notify(lambda: self._cmds.put(("wake", None)))
        self.trainer = Trainer(self._train, engine.cfg.train_max_tokens)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        return cls(build_engine(cfg))

    @classmethod
    def from_model_dir(cls, model_dir: str, **kw) -> AsyncEngine:
        return cls.from_config(EngineConfig(model_dir=str(model_dir), **kw))

    # -- what the server reads -------------------------------------------------------------------
    @property
    def adapter_manager(self):
        """The AdapterManager (None without a catalog): its catalog and catalog reads only."""
        return self.engine.adapters

    @property
    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot

    def residency(self, key: tuple[str, str]) -> str:
        """Where a revision is: gpu (device pool), cpu (CPU cache) or disk; or quarantined
        (its numbers went non-finite: never served again by this engine)."""
        if self.engine.snapshot.quarantine_reason(key) is not None:
            return "quarantined"
        if key in self.engine.snapshot.resident:
            return "gpu"
        mgr = self.engine.adapters
        return "cpu" if mgr is not None and key in mgr.cpu_cache else "disk"

    def describe_adapter(self, adapter_id: str) -> dict:
        """Policy record, revisions and residency of adapter_id (blocking catalog reads)."""
        return self.engine.adapters.describe(adapter_id, self.residency)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._cmds.put(("wake", None))
        await asyncio.to_thread(self._thread.join, 10)
        self._thread = None
        close_trainer(self.engine)
        if (compiler := getattr(self.engine, "compiler", None)) is not None:
            compiler.close()  # stops after the bucket in hand
        if self.sourcing is not None:
            self.sourcing.close()
        if self.engine.adapters is not None:
            self.engine.adapters.close()

    # -- commands -------------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread between steps; its result or exception."""
        await self.start()
        fut: Future = Future()
        self._cmds.put(("call", (fn, fut)))
        return await asyncio.wrap_future(fut)

    async def _train(self, op: str, args: list):
        """One training operation on the engine thread, between two steps (engine/training.py);
        a queued pass (`run`) answers when the engine loop's slices have run it."""
        value = await self.call(lambda eng: trainer_of(eng).handle(op, args))
        if isinstance(value, Future):
            return await asyncio.wrap_future(value)
        return value

    async def unload_adapter(self, adapter_id: str) -> int:
        """Evict adapter_id's idle revisions from the device pool and the CPU tier (catalog
        errors, e.g. 404 for an unknown id, are raised before anything changes)."""
        await asyncio.to_thread(self.engine.adapters.catalog.policy, adapter_id)
        return await self.call(lambda eng: eng.unload_adapter(adapter_id))

    # -- EngineFrontend -------------------------------------------------------------------------
    def _submit(self, req: GenerateRequest, record) -> None:
        spec = req.params.structured
        compiled = None if spec is None else self.engine.grammars.prepare(spec)
        if compiled is not None and not compiled.done():
            # compiled on the grammar workers, then admitted by the engine thread: neither the
            # event loop nor a step waits for a compile
            self._cmds.put(("compiling", req.request_id))
            # the bound: past it the request fails (a compile under way cannot be stopped)
            timer = threading.Timer(self.engine.grammars.compile_timeout_s, self._cmds.put,
                                    [("compile_late", req)])
            timer.daemon = True
            self.engine.grammars.when_ready(timer.start)

            def done(fut: Future) -> None:  # a grammar worker
                timer.cancel()
                self._cmds.put(("compiled", (req, record, fut)))

            compiled.add_done_callback(done)
            return
        self._cmds.put(("add", (self.engine.make_sequence(req, record), req.stream)))

    def _abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    # -- engine thread --------------------------------------------------------------------------
    def _admit_compiled(self, req: GenerateRequest, record, compiled: Future) -> list[RequestOutput]:
        """A request whose grammar was compiled after it was submitted: admitted, or failed
        alone if the grammar did not compile; dropped if it was aborted meanwhile."""
        if req.request_id not in self._compiling:
            return []
        self._compiling.discard(req.request_id)
        try:
            if compiled.exception() is not None:
                raise compiled.exception()
            seq = self.engine.make_sequence(req, record)  # its grammar is cached now
        except Exception as exc:
            return [RequestOutput.failed(req.request_id, exc, len(req.prompt_token_ids))]
        return self._loop_state.add(seq, req.stream)

    def _run(self) -> None:
        loop = self._loop_state
        while not self._stop.is_set():
            cmd = self._next_cmd(loop)
            outs: list[RequestOutput] = []
            while cmd is not None:  # every command that is here (training slices run in step)
                outs.extend(self._apply(cmd))
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            outs.extend(loop.serve())
            if outs:  # before the slice: a token never waits for it
                self._loop.call_soon_threadsafe(self._deliver, outs)
            loop.train()

    def _next_cmd(self, loop: EngineLoop):
        """Busy: take a command if one is there. Idle: sleep until one arrives (a page-in wakes
        us too); with queued work the last step could not run, look again after a moment."""
        try:
            if loop.busy:
                return self._cmds.get_nowait()
            return self._cmds.get(timeout=_IDLE_WAIT_S if self.engine.scheduler.has_work else None)
        except queue.Empty:
            return None

    def _apply(self, cmd) -> list[RequestOutput]:
        kind, arg = cmd
        loop = self._loop_state
        if kind == "add":
            return loop.add(*arg)
        if kind == "compiling":
            self._compiling.add(arg)
            return []
        if kind == "compiled":
            return self._admit_compiled(*arg)
        if kind == "compile_late" and arg.request_id in self._compiling:
            self._compiling.discard(arg.request_id)
            error = self.engine.grammars.timeout_error(arg.params.structured)
            return [RequestOutput.failed(arg.request_id, error, len(arg.prompt_token_ids))]
        if kind == "abort":
            if arg in self._compiling:  # not in the engine yet: it never will be
                self._compiling.discard(arg)
            else:
                loop.abort(arg)
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(loop.call(fn))
            except Exception as exc:
                fut.set_exception(exc)
        return []
