"""Training runs in the engine core: LoRA factors on the engine's own model, between decode steps.

`TrainerCore` lives beside the `LLMEngine` and is only touched on the engine's owner thread
(the engine thread in process, the core's main thread in the engine-core process), so a training
slice and a decode step never run at once and the model needs no lock.

A forward or forward_backward is queued (`run`, answered through a Future when its last slice
ran) and the engine loop drives it (`EngineCore.train`): after each serving step it runs at most
ONE slice of all the queued training (`slice_turn`), of at most `train_max_tokens` tokens: the
next datums of the pass whose tenant is furthest behind in the scheduler's fair share, batched
with those of other runs' passes waiting too (train/grouped.py), or one chunk of a datum longer
than the budget (train/chunked.py, forward chunks then backward chunks). The slice runs only in
training's turn (`Scheduler.training_turn`): its tenant, charged its tokens, is not ahead of
another tenant with serving work. (Before, every run drove its own slices with one call each;
the core took every call that had arrived before its next step, so N runs put N slices back to
back between two decode steps, and a request queued behind them.)

A slice gives way part way: it computes on the core's trainer thread while the owner thread
waits (train/preempt.py, `Handoff`), and at each preemption point (each decoder layer's
attention and MLP, forward and backward) it parks when the hosting has a message or a wake-up
waiting (`has_input`): the owner runs its turns (the new request's prefill, decode steps) and
resumes the slice in a later turn, under the rule that starts one: no serving step ran a batch,
or it is training's turn. So a request that arrives while a slice runs waits for one layer's
attention or MLP of it, not for its rest, and however many runs train, a serving step waits for
one slice at most. The parked slice is `inflight`; ops that would change what it computes
with (an optim_step or a load_state of one of its runs, an `advance`) first let it finish, and
one whose passes all ended meanwhile (dropped, or their callers gone) is abandoned.
`begin` / `advance` run a pass slice by slice on the caller's say (tests, bench), on the owner
thread, whole.

A process's first optimizer imports torch._dynamo (2.6 s on the 2-core box): the first `create`
starts that import on a thread of its own and answers when it is done (a Future, finished by the
engine loop), so that serving goes on meanwhile instead of stopping for it; training operations
that come meanwhile wait behind it, in order.
After each optim_step a run's state is written for a core restart by a writer thread
(train/resume.py).

Every argument and result is plain data (lists, dicts, bytes): the same calls travel over the
engine-core socket (`call("train", [op, args])`) as they run in process. Errors the caller made
are EngineError 400 (`training_error`); a run id this core does not hold is a 404.
"""
from __future__ import annotations

import json
import struct
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ...catalog.base import trained_fingerprint
from ...catalog.layout import save_revision
from ...train.config import RunConfig, TrainingError
from ...train.resume import ResumeWriter, snapshot
from ...train.grouped import pick, run_group
from ...train.preempt import Handoff, preemption_points
from ...train.run import AdamParams, Datum, Pass, TrainingRun
from ..types import EngineError
from .llm_engine import LLMEngine

_CORES: weakref.WeakKeyDictionary[LLMEngine, TrainerCore] = weakref.WeakKeyDictionary()
_OPTIMIZER_READY = threading.Event()  # torch.optim's first optimizer was made in this process
_OPTIMIZER_WARMING = threading.Lock()


def _warm_optimizer(notify) -> None:
    """Make a first optimizer on a thread (it imports torch._dynamo), once per process; then
    `notify()` (wakes the engine's owner thread, which finishes the creates that waited)."""
    if not _OPTIMIZER_WARMING.acquire(blocking=False):
        return

    def warm() -> None:
        try:
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4, foreach=False)
        finally:
            _OPTIMIZER_READY.set()
            notify()

    threading.Thread(target=warm, name="loraserve-optimizer-import", daemon=True).start()


def trainer_of(engine: LLMEngine) -> TrainerCore:
    """The engine's TrainerCore (made on first use: an engine that never trains holds none)."""
    core = _CORES.get(engine)
    if core is None:
        core = _CORES[engine] = TrainerCore(engine)
    return core


def trainer_if_any(engine: LLMEngine) -> TrainerCore | None:
    """The engine's TrainerCore if it ever trained (the engine loop asks every turn)."""
    return _CORES.get(engine)


def close_trainer(engine: LLMEngine) -> None:
    """At engine shutdown: a parked slice abandoned, the trainer thread gone, every resume state
    queued on disk (the writer thread gone)."""
    core = _CORES.get(engine)
    if core is not None:
        core.handoff.close()
        core.writer.flush()


def _never() -> bool:
    return False


@dataclass(slots=True)
class InFlight:
    """A slice handed to the trainer thread that parked before its end."""

    group: list[Pass]   # the passes it computes, its lead first
    work: list[int]     # each one's `work` before the slice (what it is charged after)
    tenant: str         # the lead pass's tenant and weight, and the slice's tokens for it:
    weight: float       # resumed under the rule that starts a slice (`Scheduler.training_turn`)
    tokens: int


def _refused(exc: Exception) -> EngineError:
    return EngineError(str(exc), status=400, code="training_error", param=getattr(exc, "param", None))


class TrainerCore:
    """The engine's training runs and their passes in progress, by id (owner thread only)."""

    OPS = ("create", "run", "begin", "advance", "optim_step", "publish", "state_blob", "load_state", "drop")

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.runs: dict[str, TrainingRun] = {}
        self.passes: dict[str, Pass] = {}
        self.payers: dict[str, tuple[str, float]] = {}  # pass id -> (tenant, fair-share weight)
        self.failures: dict[str, BaseException] = {}  # pass id -> how it failed in another's slice
        self.resume: dict[str, Path] = {}  # run id -> where its state goes after each step
        self.queue: dict[str, tuple[Future, int]] = {}  # queued pass id -> (its answer, budget), oldest first
        # operations waiting for the optimizer import (a create first), in arrival order
        self.waiting: list[tuple[Future, str, list]] = []
        self.slices = 0  # slices started (each in a turn of the engine loop)
        self.handoff = Handoff()  # the trainer thread that computes queued slices
        self.inflight: InFlight | None = None  # the slice parked part way, if any
        self.writer = ResumeWriter()

    @property
    def has_queued(self) -> bool:
        """Training the engine loop drives waits for a turn: slices (a parked one too), or
        creates whose optimizer import is done."""
        return bool(self.queue) or self.inflight is not None or bool(self.waiting and _OPTIMIZER_READY.is_set())

    def handle(self, op: str, args: list) -> Any:
        """Run one operation; TrainingError / ValueError become a 400 EngineError. A queued
        pass (`run`), and a `create` before this process's optimizer import is done, answer
        through a Future that the engine loop finishes (and so do the operations that come
        while such a create waits: in order, after it)."""
        if op not in self.OPS:
            raise EngineError(f"unknown training operation {op!r}", status=400, code="training_error")
        try:
            if self.waiting or (op == "create" and not _OPTIMIZER_READY.is_set()):
                if op == "create":
                    RunConfig(**args[1])  # a bad config is refused now
                    _warm_optimizer(self.engine._notify)
                answer: Future = Future()
                self.waiting.append((answer, op, args))
                return answer
            return getattr(self, op)(*args)
        except (TrainingError, ValueError) as exc:
            raise _refused(exc) from exc

    def _finish_waiting(self) -> None:
        """The operations that waited for the optimizer import, in order, once it is done."""
        if not (self.waiting and _OPTIMIZER_READY.is_set()):
            return
        waiting, self.waiting = self.waiting, []
        for answer, op, args in waiting:
            try:
                value = getattr(self, op)(*args)
            except (TrainingError, ValueError) as exc:
                _reply(answer, error=_refused(exc))
            except Exception as exc:  # EngineError (e.g. an unknown run), or a bug
                _reply(answer, error=exc)
            else:
                if isinstance(value, Future):  # a queued pass: its answer is this one's
                    value.add_done_callback(lambda f, a=answer: _reply(a, None if f.exception() else f.result(),
                                                                       f.exception()))
                else:
                    _reply(answer, value)

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

    def run(self, run_id: str, pass_id: str, data: list, loss: str, loss_config: dict | None,
            backward: bool, tenant: str, weight: float, max_tokens: int) -> Future:
        """Check a pass (as `begin`; a bad one is refused now) and queue it for the engine loop's
        slices of at most `max_tokens` tokens (`slice_turn`); the Future gets its result (as
        `advance` gives it) or its error, set on this thread."""
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {max_tokens}", status=400, code="training_error")
        self.begin(run_id, pass_id, data, loss, loss_config, backward, tenant, weight)
        answer: Future = Future()
        self.queue[pass_id] = (answer, max_tokens)
        return answer

    def begin(self, run_id: str, pass_id: str, data: list, loss: str, loss_config: dict | None,
              backward: bool, tenant: str, weight: float) -> None:
        """Check a pass (datums as [tokens, {input: values}]) and hold it for `advance`; its
        slices are charged to `tenant` in the scheduler's fair share (with `weight`), where it
        counts as the tenant's work until it ends."""
        if pass_id in self.passes:
            raise EngineError(f"training pass {pass_id!r} exists", status=400, code="training_error")
        device = self.engine.device
        datums = [Datum(torch.tensor(tokens, dtype=torch.long, device=device),
                        {k: torch.tensor(v, dtype=torch.long if k == "target_tokens" else torch.float32,
                                         device=device) for k, v in inputs.items()})
                  for tokens, inputs in data]
        self.passes[pass_id] = self._run(run_id).start(datums, loss, loss_config, backward=backward)
        self.payers[pass_id] = (tenant, weight)
        self.engine.scheduler.train_joined(tenant, weight)

    def slice_turn(self, served: bool, has_input: Callable[[], bool] = _never) -> bool:
        """One slice of the queued training, if it is training's turn; whether one ran (or the
        parked one went on). It runs on the trainer thread until it ends, or parks at a
        preemption point because `has_input()` says the hosting has a message or a wake-up
        waiting; a parked slice goes on in a later turn, under the same rule as a new one.

        The pass: the oldest queued one of the tenant that would be least ahead after its slice
        (its virtual time plus the slice's tokens over its weight; arrival order on ties). With
        `served` (the serving step just before ran a batch), it runs only if the scheduler says
        it is training's turn (`Scheduler.training_turn`); else (nothing to serve, or nothing
        that could run) it runs. Passes that end in the slice get their answers."""
        self._finish_waiting()
        for pass_id in [k for k, (answer, _) in self.queue.items() if answer.cancelled()]:
            self._end(pass_id)  # nobody waits for it (its caller went away): it never finishes
        self._abandon_orphan()
        sched, f = self.engine.scheduler, self.inflight
        if f is not None:
            if served and not sched.training_turn(f.tenant, f.tokens, f.weight):
                return False
            self._clear_serving_lora()  # the serving steps meanwhile set their own slots
            if self.handoff.resume(has_input):
                self._land()
            return True
        if not self.queue:
            return False
        best, seen = None, set()
        for pass_id, (_, budget) in self.queue.items():
            tenant, weight = self.payers[pass_id]
            if tenant in seen:
                continue
            seen.add(tenant)
            work = self.passes[pass_id].next_work(budget)
            finish = sched.vtime(tenant) + work / weight
            if best is None or finish < best[0]:
                best = (finish, pass_id, tenant, weight, work)
        _, pass_id, tenant, weight, work = best
        if served and not sched.training_turn(tenant, work, weight):
            return False
        p, budget = self.passes[pass_id], self.queue[pass_id][1]
        if p.done:  # its datums all ran in other passes' slices
            self._settle({})
            return True
        group, whole = self._start(p, budget)
        self.inflight = InFlight(group, [q.work for q in group], tenant, weight, work)
        model = self.engine.model

        def job() -> dict[Pass, BaseException]:
            with preemption_points(model, self.handoff.point):
                return self._compute(group, whole, budget, self.handoff.point)

        if self.handoff.run(job, has_input):
            self._land()
        return True

    def _land(self) -> None:
        """The in-flight slice ended (or was abandoned): charge and answer its passes that are
        still here."""
        f, self.inflight = self.inflight, None
        try:
            failed = self.handoff.result()
        except BaseException as exc:  # the preemption points' own fault: the slice failed
            failed = {q: exc for q in f.group}
        self._charge(f.group, f.work)
        live = {id(q) for q in self.passes.values()}
        self._settle({q: exc for q, exc in failed.items() if id(q) in live})

    def _finish_inflight(self, run: TrainingRun | None = None) -> None:
        """Let the parked slice (if any; with `run`, only one computing for it) run to its end
        now, before something that would change what it computes with."""
        f = self.inflight
        if f is None or (run is not None and all(q.run is not run for q in f.group)):
            return
        self._clear_serving_lora()
        self.handoff.finish()
        self._land()

    def _abandon_orphan(self) -> None:
        """A parked slice whose passes all ended (dropped, callers gone) computes no more."""
        f = self.inflight
        live = {id(q) for q in self.passes.values()}
        if f is not None and not any(id(q) in live for q in f.group):
            self.handoff.abandon()
            self._land()

    def advance(self, pass_id: str, max_tokens: int) -> dict | None:
        """Run one slice of a `begin`-held pass now, batched with the next datums of other runs'
        passes waiting too (`_slice`); its result (outputs as lists, metrics) once its last datum
        ran, in its own slice or another pass's. A failure ends the pass (its gradients never
        reach the run)."""
        p = self.passes.get(pass_id)
        if p is None or pass_id in self.queue:
            raise EngineError(f"no training pass {pass_id!r} held for advance", status=404, code="not_found")
        self._finish_inflight()  # its hooks and passes are the model's until it ends
        failure = self.failures.pop(pass_id, None)
        try:
            if failure is None and not p.done:
                failed = self._slice(p, max_tokens)
                failure = failed.pop(p, None)
                self._settle(failed)
            if failure is not None:
                raise failure
            result = p.finish() if p.done else None
        except BaseException:
            self._end(pass_id)
            raise
        if result is None:
            return None
        self._end(pass_id)
        return _answer(result)

    def _settle(self, failed: dict[Pass, BaseException]) -> None:
        """After a slice: each queued pass that failed in it or is done gets its answer and ends;
        a failure of a `begin`-held pass is kept for its own next `advance` to raise."""
        ids = {id(q): qid for qid, q in self.passes.items()}
        for q, exc in failed.items():
            if ids[id(q)] not in self.queue:
                self.failures[ids[id(q)]] = exc
        for pass_id in [k for k in self.queue]:
            p = self.passes[pass_id]
            exc = failed.get(p)
            if exc is None and not p.done:
                continue
            answer = self.queue[pass_id][0]
            try:
                if answer.cancelled():  # its caller went away: its gradients never reach the run
                    continue
                if exc is not None:
                    raise exc
                result = _answer(p.finish())
            except (TrainingError, ValueError) as err:
                _reply(answer, error=_refused(err))
            except Exception as err:  # a bug: the caller's 500, the engine goes on
                _reply(answer, error=err)
            else:
                _reply(answer, result)
            finally:
                self._end(pass_id)

    def _slice(self, p: Pass, max_tokens: int) -> dict[Pass, BaseException]:
        """One slice of at most `max_tokens` on this thread, whole (`advance`): see `_start`.
        Each pass's tenant pays for its own rows, failed or not. The passes that failed, with why."""
        group, whole = self._start(p, max_tokens)
        work = [q.work for q in group]
        failed = self._compute(group, whole, max_tokens)
        self._charge(group, work)
        return failed

    def _start(self, p: Pass, max_tokens: int) -> tuple[list[Pass], bool]:
        """A slice's passes: p's next whole datums and, one datum each in turn, those of other
        runs' passes that wait (one pass per run), as ONE batch through the base
        (train/grouped.py; whole = True); or the next chunk of p's datum longer than the budget,
        alone. The serving LoRA state is cleared for it."""
        self.slices += 1
        self._clear_serving_lora()
        group, runs, whole = [p], {id(p.run)}, p.groupable(max_tokens)
        if whole:
            for qid, q in self.passes.items():
                if qid not in self.failures and id(q.run) not in runs and q.groupable(max_tokens):
                    group.append(q)
                    runs.add(id(q.run))
        return group, whole

    def _clear_serving_lora(self) -> None:
        if self.engine.runner.lora is not None:  # the wrappers add nothing during a training forward
            self.engine.runner.lora.set_slots([])

    @staticmethod
    def _compute(group: list[Pass], whole: bool, max_tokens: int,
                 point: Callable[[], None] | None = None) -> dict[Pass, BaseException]:
        """The slice's forward (and backward): the passes that failed, with why. `point`: the
        preemption point a chunk also calls between its attention's query blocks."""
        try:
            if whole:
                return run_group(pick(group, max_tokens))
            group[0].advance(max_tokens, point)
            return {}
        except BaseException as exc:  # beyond a loss of one run (or abandoned): every pass of it fails
            return {q: exc for q in group}

    def _charge(self, group: list[Pass], work: list[int]) -> None:
        """Each pass's tenant pays for what the slice computed for it (one that ended meanwhile,
        dropped or its caller gone: nobody)."""
        ids = {id(q): qid for qid, q in self.passes.items()}
        for q, before in zip(group, work):
            if id(q) in ids:
                tenant, weight = self.payers[ids[id(q)]]
                self.engine.scheduler.charge(tenant, q.work - before, weight)

    def _end(self, pass_id: str) -> None:
        tenant, _ = self.payers.pop(pass_id)
        del self.passes[pass_id]
        self.failures.pop(pass_id, None)
        self.queue.pop(pass_id, None)
        if all(t != tenant for t, _ in self.payers.values()):
            self.engine.scheduler.train_left(tenant)

    def optim_step(self, run_id: str, adam: dict) -> dict:
        """One Adam step: {metrics, steps} (the run's step count after it, which its resume
        state, written behind, carries too). Refused with a 400 naming the parameter when an
        Adam parameter is out of range or the step would take the factors past what serving
        admits (train/run.py); the run is then as it was, its gradients kept."""
        run = self._run(run_id)
        self._finish_inflight(run)  # autograd holds its factors until the slice's backward ran
        if not isinstance(adam, dict) or set(adam) - set(AdamParams.__dataclass_fields__):
            raise EngineError(f"adam_params must hold only {sorted(AdamParams.__dataclass_fields__)}",
                              status=400, code="training_error", param="adam_params")
        metrics = run.optim_step(AdamParams(**adam), serving_dtype=self.engine.dtype)
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
        checked servable as every revision is (`save_revision`) before anything is served. It
        records the base it was trained on (`catalog.base.trained_fingerprint`: a quantized
        base's own fingerprint, the float base's for a GGUF repack)."""
        mgr = self.engine.adapters
        if mgr is None:
            raise EngineError("this server has no adapter catalog: start it with --catalog to save "
                              "weights for sampling", status=400, code="training_error")
        weights = self._run(run_id).factors.serving_weights(trained_fingerprint(mgr.base_fingerprint),
                                                            self.engine.dtype, source)
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
        self._finish_inflight(run)
        tensors = safetensors.torch.load(bytes(blob))
        steps = int(_metadata(blob).get("steps", "0"))
        run.load_state({k: v.to(self.engine.device) for k, v in tensors.items()}, steps, optimizer=optimizer)
        if keep:
            self._keep(run_id, run)
        return run.steps

    def drop(self, run_id: str) -> bool:
        """Forget a run (and its passes: a queued one's caller gets a 404); True if it was here."""
        run = self.runs.get(run_id)
        for pass_id in [k for k, p in self.passes.items() if p.run is run]:
            queued = self.queue.get(pass_id)
            self._end(pass_id)
            if queued is not None:
                _reply(queued[0], error=EngineError(f"training run {run_id!r} was unloaded before this "
                                                    "pass ended", status=404, code="model_not_found"))
        self._abandon_orphan()
        path = self.resume.pop(run_id, None)
        if path is not None:
            self.writer.discard(path)
        return self.runs.pop(run_id, None) is not None


def _reply(answer: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Answer a queued pass's caller, unless it went away (cancelled its Future meanwhile)."""
    try:
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)
    except InvalidStateError:
        pass


def _answer(result) -> dict:
    """A pass's result as plain data: outputs as lists, metrics."""
    return {"outputs": [{k: v.cpu().tolist() for k, v in out.items()} for out in result.outputs],
            "metrics": result.metrics}


def _metadata(blob: bytes) -> dict[str, str]:
    """A safetensors blob's `__metadata__` (its header: an 8-byte length, then JSON)."""
    n = struct.unpack("<Q", bytes(blob[:8]))[0]
    return json.loads(bytes(blob[8:8 + n])).get("__metadata__", {}) or {}
