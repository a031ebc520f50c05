"""A training slice that gives way to serving part way through: it computes on a thread of its
own, only while its owner (the engine's owner thread) waits for it, and parks at a preemption
point when the owner has serving work waiting, handing control back until the owner resumes it.

Why a thread: a slice of a long datum took 60-220 ms of CPU on the demo base, against a time to
first token of 11-30 ms, and a request that came while it ran waited for all of its rest. A
forward could be cut between layers by hand; a backward cannot, autograd runs it to its end in
one call. On a thread of its own, a hook inside that call can wait.

Preemption points (`preemption_points`): before each decoder layer, its attention and its MLP
and the unembedding, in a forward and in a backward's recomputation of a checkpointed layer
(forward pre-hooks), and in a backward before each of those modules' own backward (a gradient
hook on its output). At a point the computing thread asks the owner's `waiting()` (a message or
a wake-up waits on the hosting's transport) and parks if so; resumed, it computes at least to its
next point, so a stream of messages slows training but cannot stop it.

No lock, because the two never compute at once: the hand-off (`Handoff`) passes one turn back
and forth, the owner waits while the trainer computes and the trainer waits while parked. What
a serving step in the middle of a parked slice shares with it, and why it stays consistent:

- the model's modules: the training hooks (train/hooks.py) and these points stay registered
  while the slice is parked and act only outside inference mode; every serving forward runs in
  inference mode (`ModelRunner.run`, the compiled decode graphs), every training forward
  outside it, and grad and inference mode are per thread in torch (autograd's device threads
  inherit the caller's);
- the serving LoRA state (`LoRAState.set_slots`), which each serving step sets: the owner
  clears it again before it resumes a slice (engine/core/training.py);
- the KV cache: none; the training attention keeps its own keys/values (chunked.py, grouped.py);
- random numbers: sampling draws from its own generators (engine/core/sampler.py), the layers
  draw none, so the global CPU generator that checkpointing saves and restores is not serving's;
- torch's intra-op threads: each calling thread has its own team; one team computes at a time.

Autograd runs a CPU backward on the calling thread, so its hooks park the trainer thread itself;
on a GPU a device thread of autograd's runs them and parks instead, the trainer waiting on it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from loraserve.model import CausalLM


def _never() -> bool:
    return False


class Abandoned(BaseException):
    """Raised at a parked slice's preemption point when its owner gave it up (every pass of it
    ended meanwhile): the slice unwinds and computes nothing more."""


class Handoff:
    """One job at a time on a thread of its own, computing only while the owner waits.

    Owner side: `run(job, waiting)` starts `job()` and returns when it ended (True) or parked
    (False); `resume(waiting)` lets a parked job go on, the same way; `finish()` resumes it to its
    end without parking; `abandon()` makes it raise `Abandoned` at its point; `result()` is what
    an ended job returned (or raises what it raised). Trainer side: `point()`, called at each
    preemption point, parks when `waiting()` says so. `parks` counts the parks."""

    def __init__(self, name: str = "loraserve-trainer"):
        self.name = name
        self._cond = threading.Condition()
        self._trainer_turn = False  # who computes: the trainer (True) or the owner
        self._job: Callable[[], Any] | None = None  # the job started and not ended
        self._result: tuple[Any, BaseException | None] | None = None
        self._waiting: Callable[[], bool] = _never
        self._abandon = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.parks = 0

    @property
    def parked(self) -> bool:
        """A job started and parked (owner side: between a hand-over's return and the next)."""
        return self._job is not None

    # -- the owner's side ---------------------------------------------------------------------
    def run(self, job: Callable[[], Any], waiting: Callable[[], bool]) -> bool:
        """Start `job()` on the thread; True once it ended, False when it parked."""
        if self._job is not None:
            raise RuntimeError("a job is parked: resume, finish or abandon it first")
        if self._closed:
            raise RuntimeError("the trainer thread is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()
        self._job, self._result, self._abandon = job, None, False
        return self._hand(waiting)

    def resume(self, waiting: Callable[[], bool]) -> bool:
        """Let the parked job compute again; True once it ended, False when it parked again."""
        if self._job is None:
            raise RuntimeError("no job is parked")
        return self._hand(waiting)

    def finish(self) -> None:
        """Resume the parked job (if any) to its end, parking no more."""
        if self._job is not None:
            self._hand(_never)

    def abandon(self) -> None:
        """End the parked job (if any): it raises `Abandoned` at its point and unwinds."""
        if self._job is not None:
            self._abandon = True
            self._hand(_never)

    def result(self) -> Any:
        """What the ended job returned; raises what it raised."""
        if self._result is None:
            raise RuntimeError("no job has ended")
        value, error = self._result
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """Abandon a parked job and let the thread end."""
        self.abandon()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _hand(self, waiting: Callable[[], bool]) -> bool:
        with self._cond:
            self._waiting, self._trainer_turn = waiting, True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._trainer_turn)
            return self._job is None

    # -- the trainer's side -------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: (self._trainer_turn and self._job is not None) or self._closed)
                if self._closed:
                    return
                job = self._job
            try:
                result: tuple[Any, BaseException | None] = (job(), None)
            except BaseException as exc:  # the job's own failures are its result, the thread goes on
                result = (None, exc)
            with self._cond:
                self._result, self._job, self._trainer_turn = result, None, False
                self._cond.notify_all()

    def point(self) -> None:
        """A preemption point of the job computing now (any other caller: nothing): park while
        the owner has work waiting."""
        if not self._trainer_turn or self._job is None:
            return
        if self._abandon:
            raise Abandoned()
        if not self._waiting():
            return
        with self._cond:
            self.parks += 1
            self._trainer_turn = False
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._trainer_turn)
        if self._abandon:
            raise Abandoned()


@contextmanager
def preemption_points(model: CausalLM, point: Callable[[], None]) -> Iterator[None]:
    """Within the block, a training forward or backward through `model` calls `point()` before
    each decoder layer, its attention, its MLP and the unembedding (forward and recomputation),
    and before each one's backward. Inference-mode forwards (serving) pass through untouched."""
    def before(module: torch.nn.Module, args: tuple) -> None:
        if not torch.is_inference_mode_enabled():
            point()

    def back(grad: Tensor) -> None:
        point()

    def after(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, Tensor) and output.requires_grad and not torch.is_inference_mode_enabled():
            output.register_hook(back)

    modules = [m for layer in model.model.layers for m in (layer, layer.self_attn, layer.mlp)]
    handles = []
    try:
        for m in [*modules, model.lm_head]:
            handles.append(m.register_forward_pre_hook(before))
            handles.append(m.register_forward_hook(after))
        yield
    finally:
        for h in handles:
            h.remove()
