"""The engine core, transport-free: what the engine's owner thread does with each message.

`EngineCore` owns the `LLMEngine` and its `EngineLoop` (steps, quiet requests, training
slices), and is the one place that admits a request (after its grammar compiled, or failed, or
ran past its bound), dispatches a call (unload, residency, warm, train) and answers where a
revision is. It speaks `engine.messages` and nothing else; a transport moves those records and
decides only how to wait between turns:

    in-thread   async_engine.AsyncEngine       a thread of the API process, a queue of records
    process     core.process.EngineCoreProc    the engine-core process, a Unix socket (msgpack),
                                               heartbeat and parent watch; supervised by
                                               client.core_client.CoreClient, which Ray
                                               replicas host too (ray_serve/replica.py)

A transport runs the core's loop (`run`) on the owner thread with three functions of its own:
how to take the messages that arrived (waiting at most `wait_s()` for one or a `wake`: a page-in
landed, a grammar compiled, a warm or a training pass finished on another thread), how to hand a
turn's deltas and replies (call returns, the handshake) over, and whether to go on. One turn:
the messages, then the requests whose grammar compiled, then the serving step; its deltas and
replies go over before the training slice (at most one), whose replies follow. A transport also
says whether a message or a wake waits now (`has_input`): a training slice gives way to it part
way, ending the turn, and goes on in a later one (train/preempt.py).

Grammar-compile admission: a request whose grammar is still compiling waits in `compiling`,
off the engine, and each turn admits those whose compile is done and fails those past the
grammar engine's bound (`GrammarEngine.late`, counted from when its tokenizer info was ready);
while any waits, `wait_s` is short, so a late one is failed within a poll of its bound. No step
and no event loop ever waits for a compile.
"""
from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from ..heartbeat import LOOP_WAITING, PROGRESS
from ..messages import (Abort, Add, Batch, CoreInfo, Hello, Malformed, Message, Ready, Residency,
                        Return, Stop, Train, Unload, Warm)
from ..types import RequestOutput
from .engine_loop import EngineLoop
from .llm_engine import LLMEngine
from .training import close_trainer, trainer_of

log = logging.getLogger(__name__)
WAITING_S = 0.05  # queued work that could not run, or a grammar compiling: look again this often


class EngineCore:
    def __init__(self, engine: LLMEngine, wake: Callable[[], None] = lambda: None,
                 has_input: Callable[[], bool] = lambda: False):
        """`wake`: any thread, make the transport's wait return (it runs a turn). `has_input`:
        any thread, whether a message or a wake-up waits on the transport (a training slice
        gives way to it part way)."""
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.loop.has_input = has_input
        self.wake = wake
        engine.set_notify(wake)  # page-ins landed, a decode bucket's compile moved on
        # what changed before this wake was installed (the background compile starts with the
        # engine, before any hosting): published now, or /ready would not list it until the
        # next change woke a turn
        engine.publish()
        self.running = True  # False once a Stop arrived
        # requests whose grammar compiles on the grammar workers: (the Add, its compile, since)
        self.compiling: dict[str, tuple[Add, Future, float]] = {}
        self._replies: queue.SimpleQueue[Ready | Return] = queue.SimpleQueue()  # any thread puts

    # -- the loop -------------------------------------------------------------------------------
    def run(self, take: Callable[[float | None], Iterable[Message | Malformed]],
            hand_over: Callable[[list[RequestOutput], list[Ready | Return]], None],
            go_on: Callable[[], bool], beat: list) -> None:
        """The owner thread's turns until a Stop, or until `go_on()` is False: `take(wait_s())`
        the messages (0: those there; None: wait until one or a wake comes), `turn` them,
        `hand_over` the deltas and replies, run at most one training slice and hand over the
        replies it made (a token never waits for a slice). Stamps `beat[PROGRESS]` at the start
        of each turn, LOOP_WAITING while it waits: waiting for a message is not being stuck."""
        while self.running and go_on():
            wait_s = self.wait_s()
            if wait_s != 0:
                beat[PROGRESS] = LOOP_WAITING
            messages = take(wait_s)
            beat[PROGRESS] = time.monotonic()
            hand_over(self.turn(messages), self.replies())
            if self.loop.train():  # passes that ended in the slice
                hand_over([], self.replies())

    def turn(self, messages: Iterable[Message | Malformed] = ()) -> list[RequestOutput]:
        """Apply `messages` in order, admit what compiled, run the serving step: the deltas to
        hand over (before the training slice)."""
        outs: list[RequestOutput] = []
        for msg in messages:
            outs.extend(self.handle(msg))
        if self.compiling:
            outs.extend(self.admit_compiled())
        outs.extend(self.loop.serve())
        return outs

    def replies(self) -> list[Ready | Return]:
        """The handshake answer and the call returns that are ready, in order."""
        out = []
        while not self._replies.empty():  # (one reader: this thread)
            out.append(self._replies.get_nowait())
        return out

    def wait_s(self) -> float | None:
        """How long the transport may wait for a message before the next turn: 0 while the
        engine is busy, WAITING_S with work that could not run or a grammar compiling, None
        (until woken) when idle."""
        if self.loop.busy:
            return 0.0
        if self.engine.scheduler.has_work or self.compiling:
            return WAITING_S
        return None

    def handle(self, msg: Message | Malformed) -> list[RequestOutput]:
        """Apply one message: the deltas it made at once (a request that failed)."""
        match msg:
            case Add():
                return self._add(msg)
            case Abort(request_id=rid):
                if self.compiling.pop(rid, None) is None:  # not in the engine yet: never will be
                    self.loop.abort(rid)
            case Batch():
                return [out for m in msg.messages for out in self.handle(m)]
            case Hello():
                self._replies.put(Ready(self.info()))
            case Stop():
                self.running = False
            case Malformed():
                return self._malformed(msg)
            case Unload() | Residency() | Warm() | Train():
                self._call(msg)
        return []

    # -- requests -------------------------------------------------------------------------------
    def _add(self, msg: Add) -> list[RequestOutput]:
        spec = msg.request.params.structured
        if spec is not None:
            compiled = self.engine.grammars.prepare(spec)
            if not compiled.done():  # admitted once compiled: a step never waits for a compile
                self.compiling[msg.request.request_id] = (msg, compiled, time.monotonic())
                compiled.add_done_callback(lambda _: self.wake())
                return []
        return self._admit(msg)

    def _admit(self, msg: Add) -> list[RequestOutput]:
        req = msg.request
        try:  # a grammar that does not compile, a quarantined revision: that request alone fails
            seq = self.engine.make_sequence(req, msg.record)
        except Exception as exc:
            return [RequestOutput.failed(req.request_id, exc, len(req.prompt_token_ids))]
        return self.loop.add(seq, req.stream)

    def admit_compiled(self) -> list[RequestOutput]:
        """Admit the requests whose grammar is now compiled; fail those whose grammar did not
        compile, or not within the grammar engine's bound (400s naming the field)."""
        outs: list[RequestOutput] = []
        grammars = self.engine.grammars
        for request_id, (msg, compiled, since) in list(self.compiling.items()):
            if not compiled.done() and not grammars.late(since):
                continue
            del self.compiling[request_id]
            req = msg.request
            error = compiled.exception() if compiled.done() else \
                grammars.timeout_error(req.params.structured)
            if error is None:
                outs.extend(self._admit(msg))
            else:
                outs.append(RequestOutput.failed(request_id, error, len(req.prompt_token_ids)))
        return outs

    def _malformed(self, msg: Malformed) -> list[RequestOutput]:
        """A frame that did not decode fails what it names, and nothing else."""
        err = msg.error
        log.error("%s", err)
        if err.call_id is not None:
            self._replies.put(Return(err.call_id, None, err))
        if err.request_id is not None:
            return [RequestOutput.failed(err.request_id, err)]
        return []

    # -- calls ----------------------------------------------------------------------------------
    def _call(self, msg: Unload | Residency | Warm | Train) -> None:
        """The one dispatch of engine calls; each is answered by one Return (an error its own)."""
        try:
            if isinstance(msg, Unload):
                self._replies.put(Return(msg.call_id, self.engine.unload_adapter(msg.adapter_id)))
            elif isinstance(msg, Residency):
                self._replies.put(Return(msg.call_id, [self.residency(k) for k in msg.keys]))
            elif isinstance(msg, Warm):  # page into the CPU tier without blocking the loop
                fut = self.engine.adapters.pager.fetch(msg.record)
                fut.add_done_callback(lambda f: self._finish(msg.call_id, f, value=False))
            else:  # a training operation (engine/training.py), between steps
                value = trainer_of(self.engine).handle(msg.op, list(msg.args))
                if isinstance(value, Future):  # a queued pass: answered after its last slice
                    value.add_done_callback(lambda f: self._finish(msg.call_id, f))
                else:
                    self._replies.put(Return(msg.call_id, value))
        except Exception as exc:
            self._replies.put(Return(msg.call_id, None, exc))

    def _finish(self, call_id: int, fut: Future, value: bool = True) -> None:
        """Any thread: the Return of a call that finished off the loop (a warm, a pass)."""
        err = fut.exception()
        self._replies.put(Return(call_id, fut.result() if value and err is None else None, err))
        self.wake()

    def residency(self, key: tuple[str, str]) -> str:
        """Where a revision is, read live on the owner thread: quarantined (its numbers went
        non-finite: never served again here), gpu (the device pool), cpu (the CPU tier) or disk."""
        mgr = self.engine.adapters
        if mgr is None:
            return "disk"
        if key in mgr.quarantined:
            return "quarantined"
        if key in mgr.pool:
            return "gpu"
        return "cpu" if key in mgr.cpu_cache else "disk"

    def info(self) -> CoreInfo:
        mgr = self.engine.adapters
        limits = mgr.pool.limits if mgr is not None else None
        return CoreInfo(os.getpid(), self.engine.model_name, self.engine.max_model_len,
                        self.engine.vocab_size, mgr.base_fingerprint if mgr is not None else None,
                        limits.max_rank if limits else 0, tuple(limits.kinds) if limits else ())

    def close(self) -> None:
        close_trainer(self.engine)
        if (compiler := getattr(self.engine, "compiler", None)) is not None:
            compiler.close()  # stops after the bucket in hand
        if self.engine.adapters is not None:
            self.engine.adapters.close()
