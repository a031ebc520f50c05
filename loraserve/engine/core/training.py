"""Training runs in the engine core: LoRA factors on the engine's own model, between decode steps.

`TrainerCore` lives beside the `LLMEngine` and is only touched on the engine's owner thread
(the engine thread in process, the core's main thread in the engine-core process), so a training
slice and a decode step never run at once and the model needs no lock. Each call is one bounded
piece of work: `advance` runs one slice of at most the per-call token budget
(`EngineConfig.train_max_tokens`): its pass's next datums batched with those of other runs'
passes waiting too (train/grouped.py), and returns; the owner thread runs a decode step before the
next slice, so serving keeps going while runs train (engine/training.py drives the slices). After
each optim_step a run's state is written for a core restart by a writer thread (train/resume.py).

Every argument and result is plain data (lists, dicts, bytes): the same calls travel over the
engine-core socket (`call("train", [op, args])`) as they run in process. Errors the caller made
are EngineError 400 (`training_error`); a run id this core does not hold is a 404.
"""
from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ...catalog.layout import save_revision
from ...train.config import RunConfig, TrainingError
from ...train.resume import ResumeWriter, snapshot
from ...train.grouped import pick, run_group
from ...train.run import AdamParams, Datum, Pass, TrainingRun
from ..types import EngineError
from .llm_engine import LLMEngine

_CORES: weakref.WeakKeyDictionary[LLMEngine, TrainerCore] = weakref.WeakKeyDictionary()


def trainer_of(engine: LLMEngine) -> TrainerCore:
    """The engine's TrainerCore (made on first use: an engine that never trains holds none)."""
    core = _CORES.get(engine)
    if core is None:
        core = _CORES[engine] = TrainerCore(engine)
    return core


def close_trainer(engine: LLMEngine) -> None:
    """At engine shutdown: every resume state queued is on disk (the writer thread is gone)."""
    core = _CORES.get(engine)
    if core is not None:
        core.writer.flush()


def _refused(exc: Exception) -> EngineError:
    return EngineError(str(exc), status=400, code="training_error")


class TrainerCore:
    """The engine's training runs and their passes in progress, by id (owner thread only)."""

    OPS = ("create", "begin", "advance", "optim_step", "publish", "state_blob", "load_state", "drop")

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.runs: dict[str, TrainingRun] = {}
        self.passes: dict[str, Pass] = {}
        self.payers: dict[str, tuple[str, float]] = {}  # pass id -> (tenant, fair-share weight)
        self.failures: dict[str, BaseException] = {}  # pass id -> how it failed in another's slice
        self.resume: dict[str, Path] = {}  # run id -> where its state goes after each step
        self.writer = ResumeWriter()

    def handle(self, op: str, args: list) -> Any:
        """Run one operation; TrainingError / ValueError become a 400 EngineError."""
        if op not in self.OPS:
            raise EngineError(f"unknown training operation {op!r}", status=400, code="training_error")
        try:
            return getattr(self, op)(*args)
        except (TrainingError, ValueError) as exc:
            raise _refused(exc) from exc

    def _run(self, run_id: str) -> TrainingRun:
        run = self.runs.get(run_id)
        if run is None:
            raise EngineError(f"training run {run_id!r} is not loaded on this engine (unloaded, or "
                              "the server restarted)", status=404, code="model_not_found")
        return run

    def create(self, run_id: str, config: dict, resume_path: str | None = None) -> dict:
        """A new run with fresh factors; refused when the serving pool could not serve its
        revisions (rank or targets beyond what it holds), so every save is servable. With
        `resume_path`, its state is written there after every optim_step and load_state
        (`_keep`), for the API side to put back after a core restart."""
        cfg = RunConfig(**config)
        run = TrainingRun(self.engine.model, cfg)
        mgr = self.engine.adapters
        if mgr is not None:
            mgr.pool.check_admissible(cfg.rank, run.factors.kinds)
        self.runs[run_id] = run
        if resume_path is not None:
            self.resume[run_id] = Path(resume_path)
        return {"kinds": run.factors.kinds, "trainable": sum(p.numel() for p in run.factors.parameters())}

    def begin(self, run_id: str, pass_id: str, data: list, loss: str, loss_config: dict | None,
              backward: bool, tenant: str, weight: float) -> None:
        """Check a pass (datums as [tokens, {input: values}]) and hold it for `advance`; its
        slices are charged to `tenant` in the scheduler's fair share (with `weight`)."""
        device = self.engine.device
        datums = [Datum(torch.tensor(tokens, dtype=torch.long, device=device),
                        {k: torch.tensor(v, dtype=torch.long if k == "target_tokens" else torch.float32,
                                         device=device) for k, v in inputs.items()})
                  for tokens, inputs in data]
        self.passes[pass_id] = self._run(run_id).start(datums, loss, loss_config, backward=backward)
        self.payers[pass_id] = (tenant, weight)

    def advance(self, pass_id: str, max_tokens: int) -> dict | None:
        """Run one slice of the pass, batched with the next datums of other runs' passes waiting
        too (`_slice`); its result (outputs as lists, metrics) once its last datum ran, in its own
        slice or another pass's. A failure ends the pass (its gradients never reach the run)."""
        p = self.passes.get(pass_id)
        if p is None:
            raise EngineError(f"no training pass {pass_id!r}", status=404, code="not_found")
        failure = self.failures.pop(pass_id, None)
        try:
            if failure is None and not p.done:
                failure = self._slice(p, max_tokens)
            if failure is not None:
                raise failure
            result = p.finish() if p.done else None
        except BaseException:
            self._end(pass_id)
            raise
        if result is None:
            return None
        self._end(pass_id)
        return {"outputs": [{k: v.cpu().tolist() for k, v in out.items()} for out in result.outputs],
                "metrics": result.metrics}

    def _slice(self, p: Pass, max_tokens: int) -> BaseException | None:
        """One slice of at most `max_tokens`: p's next whole datums and, one datum each in turn,
        those of other runs' passes that wait (one pass per run), as ONE batch through the base
        (train/grouped.py); or the next chunk of p's datum longer than the budget, alone. Each
        pass's tenant pays for its own rows, failed or not. p's failure is returned; another
        pass's is kept for its own next `advance` to raise."""
        if self.engine.runner.lora is not None:  # the wrappers add nothing during a training forward
            self.engine.runner.lora.set_slots([])
        ids = {q: qid for qid, q in self.passes.items() if qid not in self.failures}
        group, runs, whole = [p], {id(p.run)}, p.groupable(max_tokens)
        if whole:
            for q in ids:
                if id(q.run) not in runs and q.groupable(max_tokens):
                    group.append(q)
                    runs.add(id(q.run))
        work = [q.work for q in group]
        try:
            if whole:
                failed = run_group(pick(group, max_tokens))
            else:
                p.advance(max_tokens)
                failed = {}
        except BaseException as exc:  # beyond a loss of one run: every pass of the slice fails
            failed = {q: exc for q in group}
        for q, before in zip(group, work):
            tenant, weight = self.payers[ids[q]]
            self.engine.scheduler.charge(tenant, q.work - before, weight)
        for q, exc in failed.items():
            if q is not p:
                self.failures[ids[q]] = exc
        return failed.get(p)

    def _end(self, pass_id: str) -> None:
        del self.passes[pass_id], self.payers[pass_id]
        self.failures.pop(pass_id, None)

    def optim_step(self, run_id: str, adam: dict) -> dict:
        """One Adam step: {metrics, steps} (the run's step count after it, which its resume
        state, written behind, carries too)."""
        run = self._run(run_id)
        metrics = run.optim_step(AdamParams(**adam))
        self._keep(run_id, run)
        return {"metrics": metrics, "steps": run.steps}

    def _keep(self, run_id: str, run: TrainingRun) -> None:
        """Queue the run's state for its resume file: a copy now (a memcpy of factors and
        moments on this thread), serialised and written by the writer thread, newest only."""
        path = self.resume.get(run_id)
        if path is not None:
            self.writer.put(path, snapshot(run.state_tensors()), run.state_metadata())

    def publish(self, run_id: str, source: str, adapter_id: str, revision: str) -> bytes:
        """The run's current factors as revision `adapter_id@revision`, servable at once: the
        serving layout goes into the CPU tier from memory (`AdapterManager.install`), no catalog
        round trip; the blob returned is what the caller writes to the catalog (durability),
        checked servable as every revision is (`save_revision`) before anything is served."""
        mgr = self.engine.adapters
        if mgr is None:
            raise EngineError("this server has no adapter catalog: start it with --catalog to save "
                              "weights for sampling", status=400, code="training_error")
        weights = self._run(run_id).factors.serving_weights(mgr.base_fingerprint, self.engine.dtype, source)
        blob = save_revision(weights)
        mgr.install((adapter_id, revision), weights)
        return blob

    def state_blob(self, run_id: str) -> bytes:
        """Training state (factors, Adam moments; step count in the metadata) as safetensors."""
        run = self._run(run_id)
        tensors = {k: v.detach().cpu().contiguous() for k, v in run.state_tensors().items()}
        return safetensors.torch.save(tensors, metadata=run.state_metadata())

    def load_state(self, run_id: str, blob: bytes, optimizer: bool, keep: bool = True) -> int:
        """Put a state blob in the run; its step count after. `keep`: write it as the resume
        state too (a load_weights; not the restore of the resume state itself)."""
        run = self._run(run_id)
        tensors = safetensors.torch.load(bytes(blob))
        steps = int(_metadata(blob).get("steps", "0"))
        run.load_state({k: v.to(self.engine.device) for k, v in tensors.items()}, steps, optimizer=optimizer)
        if keep:
            self._keep(run_id, run)
        return run.steps

    def drop(self, run_id: str) -> bool:
        """Forget a run (and its passes); True if it was here."""
        self.passes = {k: p for k, p in self.passes.items() if p.run is not self.runs.get(run_id)}
        self.payers = {k: v for k, v in self.payers.items() if k in self.passes}
        self.failures = {k: v for k, v in self.failures.items() if k in self.passes}
        path = self.resume.pop(run_id, None)
        if path is not None:
            self.writer.discard(path)
        return self.runs.pop(run_id, None) is not None


def _metadata(blob: bytes) -> dict[str, str]:
    """A safetensors blob's `__metadata__` (its header: an 8-byte length, then JSON)."""
    n = struct.unpack("<Q", bytes(blob[:8]))[0]
    return json.loads(bytes(blob[8:8 + n])).get("__metadata__", {}) or {}
