"""What the engine's owner thread does between steps, wherever that thread lives.

`EngineLoop` applies commands (add, abort) and runs steps, returning the token-id deltas to
hand over. `EngineCore` (`core.engine_core`) owns it on its transport's thread; it is the only
code that touches the `LLMEngine`.

A non-streamed request without stop strings is *quiet*: its first delta goes out at once (errors
and time to first token surface as early as ever), the rest are merged here and go out when it
ends. Nothing on the API side needs them sooner, and a delta per step per request would wake the
API process every step, taking CPU from the engine's intra-op threads on a small machine. A
request with stop strings sends every step's delta: the API side's `OutputProcessor` must see
its text to end it.

Training shares the turns: after its serving step (`serve`), a turn runs at most one slice of
the queued training (`train`, `TrainerCore.slice_turn`), and only in training's turn of the fair
share, so a serving step never waits for more than one slice, however many runs train. The
hostings hand the serving step's deltas over before the slice runs: a token never waits for the
slice after the step that made it. A slice gives way part way when `has_input()` (set by the
hosting: a message or a wake-up waits on its transport) says so, at its next preemption point
(train/preempt.py): the turn ends there, and a later turn resumes the slice, so a request that
arrives while a slice runs is admitted and prefilled after one layer's attention or MLP of it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from .llm_engine import LLMEngine
from .sequence import Sequence
from .training import trainer_if_any
from ..types import FIRST, RequestOutput, coalesce

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # quiet requests -> FIRST, None (nothing held) or the merged deltas since the first (`coalesce`)
        self._quiet: dict[str, object] = {}
        # when a list: each turn's work in order, "prefill" / "decode" (a serving step that ran a
        # batch), "train" (a training slice, or the parked one going on) and "parked" after it
        # when it gave way before its end; tests read the interleaving from it
        self.trace: list[str] | None = None
        # whether the hosting has a message or a wake-up waiting (any thread may ask; a slice
        # gives way to it); none without a transport
        self.has_input: Callable[[], bool] = lambda: False

    def add(self, seq: Sequence, stream: bool = True) -> list[RequestOutput]:
        try:
            self.engine.add_sequence(seq)
        except Exception as exc:  # e.g. a duplicate request id: that request alone fails
            return [self.engine.output.error(seq, exc)]
        if not stream and not seq.params.stop:
            self._quiet[seq.request_id] = FIRST
        return []

    def abort(self, request_id: str) -> None:
        self._quiet.pop(request_id, None)
        self.engine.abort(request_id)  # nobody listens any more: its final delta is dropped

    @property
    def busy(self) -> bool:
        """The last step ran a batch, or training waits for slices: step again without waiting
        for a command."""
        if self.engine.last_batch_size > 0:
            return True
        trainer = trainer_if_any(self.engine)
        return trainer is not None and trainer.has_queued

    def step(self) -> list[RequestOutput]:
        """A whole turn: the serving step, then at most one training slice (tests, drivers that
        hand the deltas over after the turn; the hostings call `serve` and `train` apart)."""
        outs = self.serve()
        self.train()
        return outs

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
        """The turn's training slice, if training waits and it is its turn (after a serving step
        that ran a batch, `TrainerCore.slice_turn` asks the fair share), until it ends or gives
        way to input (`has_input`); whether one ran."""
        trainer = trainer_if_any(self.engine)
        if trainer is None or not trainer.has_queued:
            return False
        try:
            sliced = trainer.slice_turn(self.engine.last_batch_size > 0, self.has_input)
        except Exception:  # a bug outside any one pass (each pass's own faults answer it)
            log.exception("training slice failed")
            sliced = False
        if sliced and self.trace is not None:
            self.trace.append("train")
            if trainer.inflight is not None:
                self.trace.append("parked")
        return sliced

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
