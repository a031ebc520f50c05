"""The engine core, transport-free: what the engine's owner thread does with each message.

`EngineCore` is the only code that touches the `LLMEngine`: it runs its steps and training
slices, merges quiet requests' deltas, and is the one place that admits a request (after its
grammar compiled, or failed, or ran past its bound), dispatches a call (unload, residency, warm,
train) and answers where a revision is. It speaks `engine.messages` and nothing else; a
transport moves those records and decides only how to wait between turns: in-thread
(`async_engine.ThreadTransport`: a queue of records) or in the engine-core process
(`core.process.EngineCoreProc`: a Unix socket, msgpack; supervised by the client's
`ProcessTransport`, which Ray replicas host too).

A transport runs the core's loop (`run`) on the owner thread with three functions of its own:
how to take the messages that arrived (waiting at most `wait_s()` for one or a `wake`: a page-in
landed, a grammar compiled, a warm or a training pass finished on another thread), how to hand a
turn's deltas and replies (call returns, the handshake) over, and whether to go on. One turn:
the messages, then the requests whose grammar compiled, then the serving step; its deltas and
replies go over before the training slice (at most one), whose replies follow: a token never
waits for the slice after the step that made it.

A non-streamed request without stop strings is *quiet*: its first delta goes out at once (errors
and time to first token surface as early as ever), the rest are merged here and go out when it
ends. Nothing on the API side needs them sooner, and a delta per step per request would wake the
API process every step, taking CPU from the engine's intra-op threads on a small machine. A
request with stop strings sends every step's delta: the API side's `OutputProcessor` must see
its text to end it.

Training shares the turns: after its serving step (`serve`), a turn runs at most one slice of
the queued training (`train`, `TrainerCore.slice_turn`), and only in training's turn of the fair
share, so a serving step never waits for more than one slice, however many runs train. A slice
gives way part way, at its next preemption point (train/preempt.py), when `has_input()` (the
transport's: a message or a wake-up waits on it) says so, or when sequences are being served and
the slice has computed for GIVE_WAY_STEPS of a decode step's time since it was handed the turn:
the turn ends there, and a later turn resumes the slice (when the fair share says it is
training's turn again). So a request that arrives while a slice runs is admitted and prefilled
after one layer's attention or MLP of it, and a stream's next token waits for at most about that
quantum of the slice, however long the slice (eight runs' datums batched into one took 10-20 s
on two loaded cores, a stall of every stream before).

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
from ..types import FIRST, RequestOutput, coalesce
from .llm_engine import LLMEngine
from .training import close_trainer, trainer_if_any, trainer_of

log = logging.getLogger(__name__)
WAITING_S = 0.05  # queued work that could not run, or a grammar compiling: look again this often
# a training slice computes this many decode steps' time (at least GIVE_WAY_MIN_S) while
# sequences are served, then parks: a stream's inter-token gap stays under about twice a step
GIVE_WAY_STEPS = 0.5
GIVE_WAY_MIN_S = 0.002
GIVE_WAY_MAX_S = 0.1  # however slow the steps (a large batch of new adapters): a piece at most this


class EngineCore:
    def __init__(self, engine: LLMEngine, wake: Callable[[], None] = lambda: None,
                 has_input: Callable[[], bool] = lambda: False):
        """`wake`: any thread, make the transport's wait return (it runs a turn). `has_input`:
        any thread, whether a message or a wake-up waits on the transport (a training slice
        gives way to it part way)."""
        self.engine = engine
        self.has_input = has_input
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
        # quiet requests -> FIRST, None (nothing held) or the merged deltas since the first (`coalesce`)
        self._quiet: dict[str, object] = {}
        # when a list: each turn's work in order, "prefill" / "decode" (a serving step that ran a
        # batch), "train" (a training slice, or the parked one going on) and "parked" after it
        # when it gave way before its end; tests read the interleaving from it
        self.trace: list[str] | None = None

    # -- the loop -------------------------------------------------------------------------------
    def run(self, take: Callable[[float | None], Iterable[Message | Malformed]],
            hand_over: Callable[[list[RequestOutput], list[Ready | Return]], None], beat: list,
            go_on: Callable[[], bool] = lambda: True) -> None:
        """The owner thread's turns (above) until a Stop, or until `go_on()` is False. `take(wait_s)`:
        the messages (0: those there; None: wait until one or a wake comes). Stamps
        `beat[PROGRESS]` at the start of each turn, LOOP_WAITING while it waits: waiting for a
        message is not being stuck."""
        while self.running and go_on():
            wait_s = self.wait_s()
            if wait_s != 0:
                beat[PROGRESS] = LOOP_WAITING
            messages = take(wait_s)
            beat[PROGRESS] = time.monotonic()
            outs = [out for msg in messages for out in self.handle(msg)]
            if self.compiling:
                outs.extend(self.admit_compiled())
            hand_over(outs + self.serve(), self.replies())
            if self.train():  # passes that ended in the slice
                hand_over([], self.replies())

    def replies(self) -> list[Ready | Return]:
        """The handshake answer and the call returns that are ready, in order (one reader: this
        thread, so as many as there are now can be taken)."""
        return [self._replies.get_nowait() for _ in range(self._replies.qsize())]

    def wait_s(self) -> float | None:
        """How long the transport may wait for a message before the next turn: 0 while the
        engine is busy, WAITING_S with work that could not run or a grammar compiling, None
        (until woken) when idle."""
        if self.busy:
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
                    self._quiet.pop(rid, None)
                    self.engine.abort(rid)  # nobody listens any more: its final delta is dropped
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

    # -- steps ----------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """The last step ran a batch, or training waits for slices: step again without waiting
        for a command."""
        if self.engine.last_batch_size > 0:
            return True
        trainer = trainer_if_any(self.engine)
        return trainer is not None and trainer.has_queued

    def serve(self) -> list[RequestOutput]:
        """The turn's serving step: its deltas, to hand over before `train`."""
        eng = self.engine
        try:
            outs = eng.step()
        except Exception as exc:  # a bug outside any one sequence: fail what is running, go on
            log.exception("engine step failed")
            outs = eng.fail_all(exc)
        if self.trace is not None and eng.last_batch_size > 0:
            self.trace.append(eng.scheduler.last_kind or "serve")
        return self._coalesce(outs) if self._quiet else outs

    def train(self) -> bool:
        """The turn's training slice, if training waits and it is its turn (above:
        `TrainerCore.slice_turn`); whether one ran."""
        trainer = trainer_if_any(self.engine)
        if trainer is None or not trainer.has_queued:
            return False
        try:
            sliced = trainer.slice_turn(self.engine.last_batch_size > 0, self._give_way())
        except Exception:  # a bug outside any one pass (each pass's own faults answer it)
            log.exception("training slice failed")
            sliced = False
        if sliced and self.trace is not None:
            self.trace.append("train")
            if trainer.inflight is not None:
                self.trace.append("parked")
        return sliced

    def _give_way(self) -> Callable[[], bool]:
        """When the slice handed the turn now parks (asked at its preemption points, on the
        trainer thread while this one waits): a message or a wake-up waits, or the scheduler
        holds sequences and the slice has computed for its quantum since now."""
        has_input, sched = self.has_input, self.engine.scheduler
        quantum = min(GIVE_WAY_MAX_S, max(GIVE_WAY_MIN_S, GIVE_WAY_STEPS * self.engine.decode_step_s))
        until = time.monotonic() + quantum
        return lambda: has_input() or (sched.has_work and time.monotonic() >= until)

    def _coalesce(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Quiet requests: pass the first delta, hold and merge the rest until the last."""
        sent = []
        for out in outs:
            rid = out.request_id
            if rid not in self._quiet:
                sent.append(out)
                continue
            last = out.finish_reason is not None or out.error is not None
            held, send = coalesce(self._quiet[rid], out, last)
            if send is not None:
                sent.append(send)
            if last:
                del self._quiet[rid]
            else:
                self._quiet[rid] = held
        return sent

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
        try:  # a grammar that does not compile, a quarantined revision, a duplicate request id:
            self.engine.add_sequence(self.engine.make_sequence(req, msg.record), msg.blob)
        except Exception as exc:  # that request alone fails
            return [RequestOutput.failed(req.request_id, exc, len(req.prompt_token_ids))]
        if not req.stream and not req.params.stop:
            self._quiet[req.request_id] = FIRST
        return []

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
