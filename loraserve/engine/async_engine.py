"""asyncio facade over LLMEngine: the engine steps on its own thread; each request gets an
asyncio.Queue of output deltas. Closing a request's iterator early aborts it in the engine.

Everything that changes engine state (a new request, an abort, an adapter unload) travels to
the engine thread as a command on one queue; everything the HTTP side reads about the engine
comes from the `EngineSnapshot` it publishes.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from .build import build_engine
from .config import EngineConfig
from .llm_engine import LLMEngine
from .snapshot import EngineSnapshot
from .types import EngineError, GenerateRequest, RequestOutput

log = logging.getLogger(__name__)
_FIRST, _STREAMED = object(), object()  # markers in AsyncEngine._quiet
_IDLE_WAIT_S = 0.05  # with queued work that cannot run yet, look again this often


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # engine thread only: non-streamed requests -> _FIRST (first delta not out yet), None
        # (nothing held) or the merged deltas since the first, handed over when the request ends
        self._quiet: dict[str, object] = {}
        # event loop only: sequences between generate() and their last delta. Bounded by a full
        # batch plus max_waiting; past it a request is refused (429) instead of queued forever.
        self._in_flight = 0
        self._tenant_in_flight: dict[str, int] = {}
        engine.set_notify(lambda: self._cmds.put(("wake", None)))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        return cls(build_engine(cfg))

    @classmethod
    def from_model_dir(cls, model_dir: str, **kw) -> AsyncEngine:
        return cls.from_config(EngineConfig(model_dir=str(model_dir), **kw))

    # -- what the server reads -------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def config(self) -> EngineConfig:
        return self.engine.cfg

    @property
    def adapter_manager(self):
        """The AdapterManager (None without a catalog): its catalog and catalog reads only."""
        return self.engine.adapters

    @property
    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot

    def stats(self) -> dict:
        return self.engine.snapshot.stats()

    def list_models(self) -> list[str]:
        return [self.model_name, *self.engine.snapshot.resident_ids()]

    def residency(self, key: tuple[str, str]) -> str:
        """Where a revision is: gpu (device pool), cpu (CPU cache) or disk."""
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
        if self.engine.adapters is not None:
            self.engine.adapters.close()

    # -- commands -------------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread between steps; its result or exception."""
        if self._thread is None:
            await self.start()
        fut: Future = Future()
        self._cmds.put(("call", (fn, fut)))
        return await asyncio.wrap_future(fut)

    async def unload_adapter(self, adapter_id: str) -> int:
        """Evict adapter_id's idle revisions from the device pool and the CPU tier (catalog
        errors, e.g. 404 for an unknown id, are raised before anything changes)."""
        await asyncio.to_thread(self.engine.adapters.catalog.policy, adapter_id)
        return await self.call(lambda eng: eng.unload_adapter(adapter_id))

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self._thread is None:
            await self.start()
        eng = self.engine
        eng.validate(req)
        if req.request_id in self._queues:  # the event loop owns _queues
            raise EngineError(f"duplicate request id {req.request_id!r}")
        self._admit(req.tenant)
        done = False
        try:
            record = await asyncio.to_thread(eng.resolve_adapter, req.adapter) if req.adapter else None
            seq = eng.make_sequence(req, record)
            q: asyncio.Queue = asyncio.Queue()
            self._queues[req.request_id] = q
            self._cmds.put(("add", (seq, req.stream)))
            while True:
                out = await q.get()
                if out.error is not None:
                    done = True
                    raise out.error
                done = out.finish_reason is not None
                yield out
                if done:
                    return
        finally:
            self._release(req.tenant)
            if self._queues.pop(req.request_id, None) is not None and not done:
                self._cmds.put(("abort", req.request_id))

    def _admit(self, tenant: str) -> None:
        """Count one more sequence in flight, or refuse it (429) when the queue is full.

        At capacity, only tenants holding at least their share of it (capacity / tenants in
        flight) are refused: one tenant's flood fills the queue with 429s for itself, not for
        the others (whose sequences may then exceed the bound by at most one share)."""
        cfg = self.engine.cfg
        cap = cfg.max_batch_size + cfg.max_waiting
        mine = self._tenant_in_flight.get(tenant, 0)
        share = cap / max(1, len(self._tenant_in_flight))
        if self._in_flight >= cap and mine >= share:
            raise EngineError(f"the server is at capacity ({self._in_flight} sequences running or "
                              "queued); retry later", status=429, code="rate_limit_exceeded")
        self._in_flight += 1
        self._tenant_in_flight[tenant] = mine + 1

    def _release(self, tenant: str) -> None:
        self._in_flight -= 1
        left = self._tenant_in_flight[tenant] - 1
        if left:
            self._tenant_in_flight[tenant] = left
        else:
            del self._tenant_in_flight[tenant]

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            cmd = self._next_cmd(eng)
            outs: list[RequestOutput] = []
            while cmd is not None:
                outs.extend(self._apply(cmd))
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            try:
                outs.extend(eng.step())
            except Exception as exc:  # a bug: fail what is running, keep serving
                log.exception("engine step failed")
                outs.extend(eng.fail_all(exc))
            outs = self._coalesce(outs) if self._quiet else outs
            if outs:
                self._loop.call_soon_threadsafe(self._dispatch, outs)

    def _next_cmd(self, eng: LLMEngine):
        """Busy: take a command if one is there. Idle: sleep until one arrives (a page-in wakes
        us too); with queued work the last step could not run, look again after a moment."""
        try:
            if eng.last_batch_size:
                return self._cmds.get_nowait()
            return self._cmds.get(timeout=_IDLE_WAIT_S if eng.scheduler.has_work else None)
        except queue.Empty:
            return None

    def _apply(self, cmd) -> list[RequestOutput]:
        kind, arg = cmd
        if kind == "add":
            seq, stream = arg
            try:
                self.engine.add_sequence(seq)
            except Exception as exc:  # e.g. a duplicate request id: that request alone fails
                return [self.engine.output.error(seq, exc)]
            if not stream:
                self._quiet[seq.request_id] = _FIRST
        elif kind == "abort":
            self._quiet.pop(arg, None)
            self.engine.abort(arg)  # nobody listens any more: its final delta is dropped
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:
                fut.set_exception(exc)
        return []

    def _coalesce(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Non-streamed requests: pass the first delta, hold and merge the rest until the last."""
        sent = []
        for out in outs:
            rid = out.request_id
            held = self._quiet.get(rid, _STREAMED)
            last = out.finish_reason is not None or out.error is not None
            if held is _STREAMED:
                sent.append(out)
                continue
            if held is _FIRST or last:
                sent.append(out if held is _FIRST or held is None else held.merged(out))
            else:
                out = out if held is None else held.merged(out)
            if last:
                del self._quiet[rid]
            else:
                self._quiet[rid] = None if held is _FIRST else out
        return sent

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
