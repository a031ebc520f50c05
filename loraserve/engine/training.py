"""The engine's training part as the API side drives it, the same on every hosting that trains.

`Trainer` sends `engine.core.training.TrainerCore` operations through the hosting's call channel
(`call(op, args)`: the engine thread's command queue in process, the engine-core socket out of
process). A forward or forward_backward is one call (`run`) that queues the pass in the core and
answers when it is done: the engine loop runs it in slices of at most `max_tokens` tokens, at
most one slice of all queued training between two serving steps and only in training's turn of
the tenants' fair share (engine/core/training.py), so a decode step waits for one slice
(`--train-max-tokens`) at most, however many runs train; and a slice gives way part way when a
request arrives (at its next decoder layer's attention or MLP, train/preempt.py), so a new
request waits for that piece of it, not for its rest. Passes of different runs share slices: the
core batches their waiting datums into one pass over the base.

A hosting that cannot train has `trainer = None` (engine/interface.py), and the server refuses
training routes there with a 400 that says so.
"""
from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

Call = Callable[[str, list], Awaitable[Any]]  # (op, args) -> the op's result, on the owner thread


class Trainer:
    """Training runs on the engine's resident base, by run id (the API side names them)."""

    def __init__(self, call: Call, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"train_max_tokens must be >= 1, got {max_tokens}")
        self._call = call
        self.max_tokens = max_tokens
        self._pass_ids = itertools.count()

    async def create(self, run_id: str, config: dict, resume_path: str | None = None) -> dict:
        """A run with `config` (RunConfig's fields): {kinds, trainable}. With `resume_path`, the
        engine writes the run's state there after every step (behind its answer, newest only)."""
        return await self._call("create", [run_id, config, resume_path])

    async def run_pass(self, run_id: str, data: list, loss: str, loss_config: dict | None,
                       backward: bool, tenant: str, weight: float = 1.0) -> dict:
        """forward (backward=False) or forward_backward over `data` ([tokens, {input: values}]),
        slice by slice: {outputs: [{logprobs, elementwise_loss}], metrics}. Its slices count in
        `tenant`'s fair share of serving (with its `weight`), as its requests' tokens do."""
        pass_id = f"{run_id}#{next(self._pass_ids)}"
        return await self._call("run", [run_id, pass_id, data, loss, loss_config, backward, tenant,
                                        weight, self.max_tokens])

    async def optim_step(self, run_id: str, adam: dict) -> dict:
        """{metrics, steps}: the step's metrics and the run's step count after it."""
        return await self._call("optim_step", [run_id, adam])

    async def publish(self, run_id: str, source: str, adapter_id: str, revision: str) -> bytes:
        """The run's factors served at once as revision `adapter_id@revision` (from memory, in
        the engine's CPU tier); the revision blob (serving layout) to write to the catalog."""
        return await self._call("publish", [run_id, source, adapter_id, revision])

    async def state_blob(self, run_id: str) -> bytes:
        return await self._call("state_blob", [run_id])

    async def load_state(self, run_id: str, blob: bytes, optimizer: bool, keep: bool = True) -> int:
        """The run's step count after; `keep`: the state becomes its resume state too."""
        return await self._call("load_state", [run_id, blob, optimizer, keep])

    async def drop(self, run_id: str) -> bool:
        return await self._call("drop", [run_id])
