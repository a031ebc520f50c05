"""The Tinker SDK's training routes: runs on the served base, their futures and checkpoints.

Every operation that touches a run answers a future at once (`{request_id, model_id}`) and runs
on in the run's order (runs.RunRecord.chain); its answer comes through the same
`retrieve_future` long poll as sampling's. The work itself is the engine's (`engine.trainer`,
engine/training.py): the run's LoRA factors live beside the resident base, in the engine core.

- `save_weights_for_sampler` writes the run's factors in the serving layout as a new catalog
  revision of the run's adapter (`<tenant>/<run>@<name>`, promoted), records
  `tinker://<run>/sampler_weights/<name>` as its alias and warms it: servable at once by `/v1`,
  the OpenAI-compatible routes and the SDK's sampling clients. Without a name (the SDK's
  `save_weights_and_get_sampling_client`) the revision is `s<n>`, named `tinker://<tenant>/<run>@s<n>`
  and not listed, and the answer is a sampling session pinned to it, so a sampler made before a
  later save keeps its revision.
- `save_weights` / `load_weights`: training state (factors and Adam moments) in a file per
  checkpoint under the state directory, named `tinker://<run>/weights/<name>`.
- A forward or forward_backward takes its datums' tokens from the tenant's and the key's
  `tokens_per_minute` buckets, serving's own (429 over them).
- A hosting without a trainer (Ray replicas) answers every training route 400, saying so.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from loraserve.catalog.aliases import record_alias
from loraserve.catalog.format import blob_checksum, read_adapter_meta
from loraserve.catalog.records import RevisionRecord
from loraserve.engine.types import EngineError, ResolvedModel
from loraserve.server.errors import APIError, clip
from loraserve.server.request_log import current_record
from loraserve.train.resume import write_atomic
from loraserve.train.config import TrainingError
from loraserve.train.run import AdamParams
from loraserve.server.tenancy import principal_of
from loraserve.server.tinker import asample as ta
from loraserve.server.tinker import sampling as ts
from loraserve.server.tinker.runs import RunRecord, RunRegistry, checkpoint_name, tenant_of
from loraserve.server.tinker.state import Future, SamplingSession


log = logging.getLogger(__name__)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class LoraConfigBody(Strict):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(Strict):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    type: str = "create_model"


class TensorBody(Strict):
    data: list[float] | list[int]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class DatumBody(Strict):
    model_input: ts.Prompt
    loss_fn_inputs: dict[str, TensorBody] = {}


class PassInput(Strict):
    data: list[DatumBody]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class ForwardBackwardBody(Strict):
    forward_backward_input: PassInput
    model_id: str
    seq_id: int | None = None
    type: str | None = None


class ForwardBody(Strict):
    forward_input: PassInput
    model_id: str
    seq_id: int | None = None
    type: str | None = None


_ADAM = AdamParams()  # the SDK's defaults, written once (loraserve.train.run)


class AdamBody(Strict):
    learning_rate: float = _ADAM.learning_rate
    beta1: float = _ADAM.beta1
    beta2: float = _ADAM.beta2
    eps: float = _ADAM.eps
    weight_decay: float = _ADAM.weight_decay
    grad_clip_norm: float = _ADAM.grad_clip_norm


class OptimStepBody(Strict):
    adam_params: AdamBody
    model_id: str
    seq_id: int | None = None
    type: str = "optim_step"


class SaveBody(Strict):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    sampling_session_seq_id: int | None = None
    overwrite: bool = False
    type: str | None = None


class LoadBody(Strict):
    model_id: str
    path: str
    optimizer: bool
    seq_id: int | None = None
    weights_access_token: str | None = None
    type: str = "load_weights"


class ModelBody(Strict):
    model_id: str
    type: str | None = None


class WeightsInfoBody(Strict):
    tinker_path: str


# -- helpers ---------------------------------------------------------------------------------------

def refuse_set(value: Any, param: str, why: str) -> None:
    """A field the SDK may send and this server does not honour: 400 naming it when it is set."""
    if value is not None:
        raise APIError(400, f"{param} is not supported: {why}", param=param, code="unsupported_parameter")


def registry(request: Request) -> RunRegistry:
    return ta.state_of(request).runs


def trainer(request: Request) -> Any:
    """The engine's trainer; 400 on a hosting that has none."""
    engine = ta.ctx_of(request).engine
    if engine.trainer is None:
        raise APIError(400, f"{clip(request.url.path)}: this server's hosting (Ray replicas, --replicas) "
                       "does not train; serve with one engine (loraserve serve) to train",
                       code="training_not_supported")
    return engine.trainer


def _run(request: Request, model_id: str) -> RunRecord:
    trainer(request)
    return registry(request).get(model_id, principal_of(request))


def submit(request: Request, run: RunRecord, op: Callable[[], Awaitable[dict]]) -> dict:
    """A future for `op`, run after the run's earlier operations; its answer or error body."""
    state = ta.state_of(request)
    if state.futures.pending >= state.futures.max_pending:
        raise APIError(429, "too many requests in flight; retry later")
    future = Future(ta.new_id("req"), ta.owner_of(request))
    state.futures.add(future)
    log = current_record()  # the request's log line names the run, its tenant and the future
    if log is not None:
        log.model, log.tenant, log.response_id = run.model_id, run.tenant, future.request_id

    async def answer() -> None:
        try:
            body = await op()
        except asyncio.CancelledError:
            state.futures.finish(future, {"error": "the server stopped before this request "
                                          "finished", "category": "server"})
            raise
        except Exception as exc:  # the SDK raises it as RequestFailedError
            body = ts.failure(exc)
        state.futures.finish(future, body)

    future.task = run.chain(answer)
    return {"request_id": future.request_id, "model_id": run.model_id}


def tensor(name: str, body: TensorBody, n: int, i: int) -> list:
    """A loss input as a flat list of `n` values; 400 unless it is a dense [n] tensor."""
    if body.sparse_crow_indices is not None or (body.shape is not None and body.shape != [n]) \
            or len(body.data) != n:
        raise APIError(400, f"datum {i}: loss_fn_inputs.{name} must be a dense tensor of shape [{n}] "
                       "(one value per model_input token)", param=f"data.{i}.loss_fn_inputs.{name}")
    return body.data


def datums(body: PassInput, max_len: int) -> list:
    """The datums as the trainer takes them: [tokens, {input: values}]; 400 for a datum past the
    served context (`--max-model-len`; a datum past `--train-max-tokens` runs in chunks)."""
    out = []
    for i, d in enumerate(body.data):
        tokens = ts.prompt_ids(d.model_input)
        if not 0 < len(tokens) <= max_len:
            raise APIError(400, f"datum {i} has {len(tokens)} tokens; a datum holds 1 to {max_len} "
                           "(the server's --max-model-len)", param=f"data.{i}.model_input")
        out.append([tokens, {k: tensor(k, v, len(tokens), i) for k, v in d.loss_fn_inputs.items()}])
    return out


def pass_output(result: dict) -> dict:
    """The SDK's ForwardBackwardOutput."""
    outputs = [{k: {"data": v, "dtype": "float32", "shape": [len(v)]} for k, v in out.items()}
               for out in result["outputs"]]
    return {"loss_fn_output_type": "TorchLossReturn", "loss_fn_outputs": outputs,
            "metrics": result["metrics"]}


def _config(body: CreateModelBody) -> dict:
    cfg = body.lora_config or LoraConfigBody(rank=32)  # the SDK's default rank
    seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
    return {"rank": cfg.rank, "seed": seed, "train_attn": cfg.train_attn, "train_mlp": cfg.train_mlp,
            "train_unembed": cfg.train_unembed}


async def create_model(body: CreateModelBody, request: Request) -> dict:
    """A new run on the served base (any other base_model: 404), in the key's tenant."""
    engine, train = ta.ctx_of(request).engine, trainer(request)
    if body.base_model not in (ta.base_model_name(engine), engine.model_name):
        raise APIError(404, f"base model {clip(body.base_model)!r} is not served here; this server "
                       f"trains LoRA on {ta.base_model_name(engine)!r}", code="model_not_found",
                       param="base_model")
    principal = principal_of(request)
    meta = {str(k): str(v) for k, v in (body.user_metadata or {}).items()} or None
    run = RunRecord(ta.new_id("run")[:20], ta.owner_of(request), tenant_of(principal),
                    body.base_model, _config(body), meta)
    runs = registry(request)
    runs.add(run)  # 429 over the tenant's runs

    async def create() -> dict:
        try:
            await train.create(run.model_id, run.config, str(runs.resume_file(run)))
        except BaseException:
            runs.runs.pop(run.model_id, None)
            raise
        return {"model_id": run.model_id, "type": "create_model"}

    return submit(request, run, create)


def charge(request: Request, run: RunRecord, tokens: int) -> float:
    """Training tokens come out of the same per-minute token buckets as serving's (the run's
    tenant's and the key's, `tokens_per_minute`): a 429 over them, nothing run. The tenant's
    fair-share weight, as its serving requests carry it (the engine charges the pass's slices
    to the tenant's share)."""
    tenancy = getattr(request.app.state, "tenancy", None)
    if tenancy is None:  # an app without keys has no limits, and every tenant weighs 1
        return 1.0
    principal, policy = principal_of(request), tenancy.keys.tenant(run.tenant)
    lease = tenancy.limiter.admit(principal, run.tenant, 0, tokens, policy.limits)
    lease.release()  # no sequence held; `used` unknown: nothing given back
    return principal.weight if policy.weight is None else policy.weight


async def run_pass(request: Request, model_id: str, body: PassInput, backward: bool) -> dict:
    run, train = _run(request, model_id), trainer(request)
    data = datums(body, ta.ctx_of(request).engine.max_model_len)  # 400s now, not in the future
    if not data:
        raise APIError(400, "data must hold at least one datum", param="data")
    n_tokens = sum(len(tokens) for tokens, _ in data)
    weight = charge(request, run, n_tokens)
    if (log := current_record()) is not None:
        log.prompt_tokens = n_tokens  # the pass's tokens, as charged

    async def op() -> dict:
        result = await on_core(request, run, lambda: train.run_pass(
            model_id, data, body.loss_fn, body.loss_fn_config, backward, run.tenant, weight))
        run.grads_pending += backward
        return pass_output(result)

    return submit(request, run, op)


def adam_params(body: AdamBody) -> dict:
    """The Adam parameters as the engine takes them; a 400 naming the field for a value no step
    can use (NaN, Inf, negative, betas outside [0, 1), eps not above 0, past float32:
    `train.run.AdamParams`), before anything is queued. A step whose update would take the
    factors past the serving bound is refused by the engine (its future fails, 400 category
    `user`) and leaves the run as it was."""
    values = body.model_dump()
    try:
        AdamParams(**values)
    except TrainingError as exc:
        raise APIError(400, str(exc), code="invalid_adam_params",
                       param=f"adam_params.{exc.param}" if exc.param else "adam_params") from None
    return values


async def optim_step(body: OptimStepBody, request: Request) -> dict:
    run, train = _run(request, body.model_id), trainer(request)
    adam = adam_params(body.adam_params)

    async def step() -> dict:  # after a restore too: a step must not run without its gradients
        lost = lost_work(run)
        if lost is not None:
            raise APIError(409, lost, code="gradients_lost")
        return await train.optim_step(run.model_id, adam)

    async def op() -> dict:
        result = await on_core(request, run, step)
        run.grads_pending, run.steps = 0, result["steps"]
        return {"metrics": result["metrics"], "type": "optim_step"}

    return submit(request, run, op)


async def save_for_sampler(body: SaveBody, request: Request) -> dict:
    """A new promoted revision of the run's adapter, served at once from the factors in memory
    (the engine's CPU tier, `Trainer.publish`); named (with its tinker:// alias, both written
    before the answer: later lookups go through the catalog) or `s<n>` with a sampling session
    pinned to it (save_weights_and_get_sampling_client), whose catalog write runs behind."""
    run, train = _run(request, body.model_id), trainer(request)
    refuse_set(body.ttl_seconds, "ttl_seconds", "saved revisions stay until deleted from the catalog")
    engine = ta.ctx_of(request).engine
    view = engine.catalog
    if view is None:
        raise APIError(400, "this server has no adapter catalog: start it with --catalog to save "
                       "weights for sampling", code="training_error")
    name = checkpoint_name(body.path) if body.path is not None else None
    state, owner = ta.state_of(request), ta.owner_of(request)

    async def op() -> dict:
        await run.written()  # revisions are written (and promoted) in the order they were saved
        if name is None:
            run.sampler_saves += 1
        revision, source = name or f"s{run.sampler_saves}", f"tinker:{run.model_id}"
        blob = await on_core(request, run, lambda: train.publish(run.model_id, source, run.adapter_id, revision))
        write = functools.partial(asyncio.to_thread, view.catalog.put_revision, run.adapter_id, blob,
                                  revision=revision, promote=True, source=source)
        if name is None:  # an unnamed save is the sampler's alone: no alias, not listed
            run.write_behind(write)
            rec = revision_record(run.adapter_id, revision, blob, source)
            resolved = ResolvedModel(rec.ref, rec.ref, (rec.adapter_id, rec.revision), rec, run.tenant)
            session = SamplingSession(ta.new_id("samp"), owner, rec.ref, f"tinker://{rec.ref}", None, resolved)
            state.samplers.put(session.id, session)
            return {"path": None, "sampling_session_id": session.id, "type": "save_weights_for_sampler"}
        rec = await write()
        entry = run.add_checkpoint("sampler", revision, len(blob))
        await asyncio.to_thread(record_alias, view.catalog, entry["tinker_path"], run.adapter_id, rec.revision)
        return {"path": entry["tinker_path"], "type": "save_weights_for_sampler"}

    return submit(request, run, op)


def revision_record(adapter_id: str, revision: str, blob: bytes, source: str) -> RevisionRecord:
    """The record the catalog writes for `blob` as `adapter_id@revision` (its `created` aside),
    made before the write: what a request needs to run the revision (and page it in again)."""
    meta = read_adapter_meta(blob, f"revision {adapter_id}@{revision}")
    return RevisionRecord(adapter_id, revision, len(blob), blob_checksum(blob), time.time(),
                          meta["base_fingerprint"], meta["rank"], meta["targets"], meta["dtype"], source)


async def save_weights(body: SaveBody, request: Request) -> dict:
    """Training state (factors, Adam moments) to `<state dir>/<tenant>/<run>/<name>.safetensors`."""
    run, train = _run(request, body.model_id), trainer(request)
    refuse_set(body.ttl_seconds, "ttl_seconds", "training checkpoints stay until the state directory is cleared")
    runs = registry(request)
    name = checkpoint_name(body.path) if body.path is not None else None

    async def op() -> dict:
        label = name or f"{sum(c['checkpoint_type'] == 'training' for c in run.checkpoints) + 1:06d}"
        target = runs.state_file(run.tenant, run.model_id, label)
        if target.exists() and not body.overwrite and name is not None:
            raise APIError(409, f"checkpoint {label!r} of {run.model_id} exists; pass overwrite=True",
                           code="checkpoint_exists", param="path")
        blob = await on_core(request, run, lambda: train.state_blob(run.model_id))
        await asyncio.to_thread(write_atomic, target, blob)
        entry = run.add_checkpoint("training", label, len(blob))
        return {"path": entry["tinker_path"], "type": "save_weights"}

    return submit(request, run, op)


# -- surviving an engine-core restart -------------------------------------------------------------

async def on_core(request: Request, run: RunRecord, call: Callable[[], Awaitable[Any]]) -> Any:
    """`call()` on the engine; when the engine no longer holds the run (its core restarted:
    runs live beside the model), the run is put back as it was after its last optim_step and
    `call()` runs again, once."""
    try:
        return await call()
    except EngineError as exc:
        if exc.code != "model_not_found":  # TrainerCore's answer for a run it does not hold
            raise
    await restore(request, run)
    return await call()


async def restore(request: Request, run: RunRecord) -> None:
    """Re-create the run in the engine from its config (the seed draws the same initial factors)
    and its resume state, if a step was taken; gradients of this step are lost, which its next
    optim_step says. The engine writes the resume state behind each step's answer (newest
    only), so a core killed within that write leaves the one before: the run is then put back
    at that step, and its next optim_step says that too."""
    path = registry(request).resume_file(run)
    await trainer(request).create(run.model_id, run.config, str(path))
    steps = 0
    if path.is_file():
        blob = await asyncio.to_thread(path.read_bytes)
        steps = await trainer(request).load_state(run.model_id, blob, True, keep=False)
    if steps < run.steps:
        run.lost_steps = (steps, run.steps if run.lost_steps is None else run.lost_steps[1])
    run.lost_grads, run.grads_pending, run.steps = run.lost_grads or run.grads_pending > 0, 0, steps
    log.warning("training run %s put back in the engine after a core restart (at step %d)", run.model_id, steps)


def lost_work(run: RunRecord) -> str | None:
    """What a core restart lost of this run since its last optim_step answered (once): the
    gradients of the step in progress, and steps whose resume state was not yet written."""
    said = []
    if run.lost_grads:
        said.append("the gradients of its forward_backward calls since the last optim_step were lost")
    if run.lost_steps is not None:
        at, had = run.lost_steps
        said.append(f"steps {at + 1}-{had} were lost, their state not yet written")
    if not said:
        return None
    at = run.steps
    run.lost_grads, run.lost_steps = False, None
    return (f"the engine core restarted during this step of {run.model_id}: {'; '.join(said)} (the run "
            f"is as after step {at}); run them again, then optim_step")


async def load_weights(body: LoadBody, request: Request) -> dict:
    """Training state of a checkpoint this key's tenant saved (of any of its runs) into a run."""
    run, train = _run(request, body.model_id), trainer(request)
    refuse_set(body.weights_access_token, "weights_access_token",
               "a key loads the checkpoints of the tenants it may see, with no other token")
    source = registry(request).checkpoint_file(body.path, principal_of(request))

    async def op() -> dict:
        blob = await asyncio.to_thread(source.read_bytes)
        run.steps = await on_core(request, run, lambda: train.load_state(run.model_id, blob, body.optimizer))
        run.grads_pending, run.lost_steps = 0, None
        return {"path": body.path, "type": "load_weights"}

    return submit(request, run, op)


async def unload_model(body: ModelBody, request: Request) -> dict:
    run, train = _run(request, body.model_id), trainer(request)
    runs = registry(request)

    async def op() -> dict:
        await train.drop(run.model_id)
        runs.runs.pop(run.model_id, None)
        await run.written()  # its last save is in the catalog before the run is gone
        return {"model_id": run.model_id, "type": "unload_model"}

    return submit(request, run, op)


async def get_info(body: ModelBody, request: Request) -> dict:
    run = _run(request, body.model_id)
    engine = ta.ctx_of(request).engine
    name = ta.base_model_name(engine)
    return {"type": "get_info", "model_id": run.model_id, "is_lora": True, "lora_rank": run.config["rank"],
            "model_name": name, "model_data": {"arch": None, "model_name": name, "tokenizer_id": name}}


async def weights_info(body: WeightsInfoBody, request: Request) -> dict:
    trainer(request)
    meta = registry(request).checkpoint_meta(body.tinker_path, principal_of(request))
    flag = lambda k: meta.get(k) == "True"  # noqa: E731
    return {"base_model": ta.base_model_name(ta.ctx_of(request).engine), "is_lora": True,
            "lora_rank": int(meta["rank"]), "train_unembed": flag("train_unembed"),
            "train_mlp": flag("train_mlp"), "train_attn": flag("train_attn")}


def _owner_name(run: RunRecord) -> str:
    return run.owner or "anonymous"


async def list_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
    trainer(request)
    runs = registry(request).visible(principal_of(request))
    page = runs[offset:offset + limit]
    return {"training_runs": [r.describe(_owner_name(r)) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}


async def get_run(model_id: str, request: Request) -> dict:
    run = _run(request, model_id)
    return run.describe(_owner_name(run))


async def list_checkpoints(model_id: str, request: Request) -> dict:
    return {"checkpoints": _run(request, model_id).checkpoints, "cursor": None}


def training_routes(router: APIRouter) -> None:
    """Mount the training routes (before the catch-all of routes the server does not have)."""
    router.add_api_route("/create_model", create_model, methods=["POST"])

    async def forward_backward(body: ForwardBackwardBody, request: Request) -> dict:
        return await run_pass(request, body.model_id, body.forward_backward_input, backward=True)

    async def forward(body: ForwardBody, request: Request) -> dict:
        return await run_pass(request, body.model_id, body.forward_input, backward=False)

    router.add_api_route("/forward_backward", forward_backward, methods=["POST"])
    router.add_api_route("/forward", forward, methods=["POST"])
    for path, fn in (("/optim_step", optim_step), ("/save_weights_for_sampler", save_for_sampler),
                     ("/save_weights", save_weights), ("/load_weights", load_weights),
                     ("/unload_model", unload_model), ("/get_info", get_info),
                     ("/weights_info", weights_info)):
        router.add_api_route(path, fn, methods=["POST"])
    router.add_api_route("/training_runs", list_runs, methods=["GET"])
    router.add_api_route("/training_runs/{model_id}", get_run, methods=["GET"])
    router.add_api_route("/training_runs/{model_id}/checkpoints", list_checkpoints, methods=["GET"])
