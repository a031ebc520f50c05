"""What the engine's owner thread does between steps, wherever that thread lives.

`EngineLoop` applies commands (add, abort, call) and runs steps, returning the token-id deltas to
hand over; every step's deltas go out, whatever the request (merging a non-streamed request's
deltas, like their text and stop strings, is the API side's `OutputProcessor`: a stop string can
end a request only once its text is known there). `AsyncEngine` runs it on a thread of the API
process; the engine-core process (`loraserve.engine.core`) runs it on its main thread behind a
ZeroMQ socket. Either way it is the only code that touches the `LLMEngine`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from .llm_engine import LLMEngine
from .sequence import Sequence
from .types import RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def add(self, seq: Sequence) -> list[RequestOutput]:
        try:
            self.engine.add_sequence(seq)
        except Exception as exc:  # e.g. a duplicate request id: that request alone fails
            return [self.engine.output.error(seq, exc)]
        return []

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)  # nobody listens any more: its final delta is dropped

    def call(self, fn: Callable[[LLMEngine], object]) -> object:
        return fn(self.engine)

    @property
    def busy(self) -> bool:
        """The last step ran a batch: step again without waiting for a command."""
        return self.engine.last_batch_size > 0

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        try:
            return eng.step()
        except Exception as exc:  # a bug outside any one sequence: fail what is running, go on
            log.exception("engine step failed")
            return eng.fail_all(exc)
