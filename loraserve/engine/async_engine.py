"""asyncio facade over LLMEngine: the engine steps on its own thread; each request gets an
asyncio.Queue of output deltas. Closing a request's iterator early aborts it in the engine."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from .config import EngineConfig
from .llm_engine import LLMEngine
from .types import GenerateRequest, RequestOutput

log = logging.getLogger(__name__)
_FIRST, _STREAMED = object(), object()  # markers in AsyncEngine._quiet


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
        engine.notify = lambda: self._cmds.put(("wake", None))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        from ..lora.setup import build_engine
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
        """The AdapterManager (None without a catalog)."""
        return self.engine.adapters

    def stats(self) -> dict:
        return self.engine.stats()

    def list_models(self) -> list[str]:
        resident = self.engine.adapters.resident_ids() if self.engine.adapters else []
        return [self.model_name, *resident]

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

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self._thread is None:
            await self.start()
        eng = self.engine
        eng.validate(req)
        key = await asyncio.to_thread(eng.resolve_adapter, req.adapter) if req.adapter else None
        seq = eng.make_sequence(req, key)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        self._cmds.put(("add", (seq, req.stream)))
        done = False
        try:
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
            self._queues.pop(req.request_id, None)
            if not done:
                self._cmds.put(("abort", req.request_id))

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            cmd = self._next_cmd(block=not eng.scheduler.has_work, parked=bool(eng.seqs))
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

    def _next_cmd(self, *, block: bool, parked: bool):
        """Idle: sleep until a command (or, with parked requests, a page-in) wakes us."""
        try:
            if not block:
                return self._cmds.get_nowait()
            return self._cmds.get(timeout=0.05 if parked else None)
        except queue.Empty:
            return None

    def _apply(self, cmd) -> list[RequestOutput]:
        kind, arg = cmd
        if kind == "add":
            seq, stream = arg
            if not stream:
                self._quiet[seq.request_id] = _FIRST
            self.engine.add_sequence(seq)
        elif kind == "abort":
            self._quiet.pop(arg, None)
            self.engine.abort(arg)  # nobody listens any more: its final delta is dropped
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
