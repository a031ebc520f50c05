"""A Tinker request against the app's state: which model a name pins, the sampling session a
request names, and `asample`'s future (started, de-duplicated, answered) and its long poll.

See routes.py for the protocol; this module holds what its handlers do.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request

from loraserve.engine.types import ResolvedModel
from loraserve.server import serving as sv
from loraserve.server.request_log import current_record
from loraserve.server.tinker import sampling as ts
from loraserve.server.errors import APIError, clip
from loraserve.server.names import lookup_error
from loraserve.server.streaming import start_all
from loraserve.server.tenancy import Admission, admit, detach_leases, principal_of
from loraserve.server.tinker.state import Future, FutureStore, SamplingSession, TinkerState

LONG_POLL_S = 30.0   # below the SDK's 45 s per retrieve_future call
ADMIT_WAIT_S = 0.05  # how long asample waits for the engine to take (or refuse, 429) the work


def state_of(request: Request) -> TinkerState:
    return request.app.state.tinker


def ctx_of(request: Request) -> sv.ServerContext:
    return request.app.state.ctx


def owner_of(request: Request) -> str | None:
    return principal_of(request).key_id


def base_model_name(engine: Any) -> str:
    """What `base_model` tells the SDK: `--tokenizer-name` (its get_tokenizer() loads that with
    AutoTokenizer), else the served name."""
    config = engine.config  # None: a test double without one
    return (config.tokenizer_name if config is not None else None) or engine.model_name


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_session(request: Request, sampling_session_id: str) -> SamplingSession:
    session = state_of(request).samplers.get(sampling_session_id)
    if session is None or session.owner != owner_of(request):
        raise APIError(404, f"sampling session {clip(sampling_session_id)} is unknown or expired "
                       "(the server restarted?); create a new sampling client",
                       code="sampling_session_not_found")
    return session


async def pin(name: str, request: Request) -> str | None:
    """The revision `name` stands for now (`tenant/name@rev`), None for the base model; 404 for
    an unknown model or adapter, or one of a tenant the key may not see: the same answer,
    naming `name` as given (names.not_found). The engine's `AdapterDirectory` decides."""
    engine = ctx_of(request).engine
    if name == base_model_name(engine):
        return None
    await state_of(request).runs.written(name)  # an unnamed save's name: once in the catalog
    resolved = await sv.resolve_model(name, principal_of(request), engine)
    return None if resolved.is_base else resolved.ref


# -- asample -------------------------------------------------------------------------------------

async def start_sample(body: ts.SampleBody, request: Request) -> Future:
    """The future of `body`: the one already made for its (sampling session, seq id), or a new
    one whose generation runs on after this returns. 429 over the key's or the engine's
    capacity, 400/404 for a request the engine refuses at once."""
    ctx, state, owner = ctx_of(request), state_of(request), owner_of(request)
    adapter, dedupe, resolved = await _target(body, request)
    if dedupe is not None and (known := state.futures.for_seq(dedupe, owner)) is not None:
        return known
    if state.futures.pending >= state.futures.max_pending:
        raise APIError(429, "too many sampling requests in flight; retry later")
    plan = ts.plan_sample(body, ctx.engine, ctx.max_seqs_per_request)
    model = body.model_path or body.base_model or adapter
    principal = principal_of(request)
    # the pinned revision (or the base), decided for this key once for the whole sample: 404
    resolved = resolved or await sv.resolve_model(adapter or ctx.engine.model_name, principal, ctx.engine)
    admitted = admit(resolved, principal, [plan.prompt], plan.n, plan.params.max_tokens)  # 429
    future = Future(new_id("req"), owner, dedupe)
    state.futures.add(future)  # before any wait: a concurrent retry finds it
    if (log := current_record()) is not None:  # the line of the request that starts the sample
        log.model, log.adapter, log.tenant = model, resolved.ref, admitted.tenant or None
        log.prompt_tokens, log.response_id = len(plan.prompt.token_ids), future.request_id
    try:
        await _launch(future, plan, resolved, admitted, ctx, state.futures)
    except BaseException as exc:
        state.futures.discard(future)
        err = lookup_error(exc, model)  # a model that does not exist: named as asked for
        if err is exc:
            raise
        raise err from exc
    return future


async def _target(body: ts.SampleBody, request: Request) -> tuple[str | None, tuple | None,
                                                                 ResolvedModel | None]:
    """(the adapter ref to sample, None: the base; the de-duplication key, if any; the
    session's revision as its save decided it, if it has one)."""
    if body.sampling_session_id is not None:
        session = sampling_session(request, body.sampling_session_id)
        dedupe = None if body.seq_id is None else (body.sampling_session_id, body.seq_id)
        return session.adapter, dedupe, session.resolved
    name = body.model_path or body.base_model
    if not name:
        raise APIError(400, "sampling_session_id or model_path is required",
                       param="sampling_session_id")
    return await pin(name, request), None, None


async def _launch(future: Future, plan: ts.SamplePlan, resolved: ResolvedModel,
                  admitted: Admission, ctx: sv.ServerContext, futures: FutureStore) -> None:
    """Submit the plan as `admitted`; what the engine refuses at once (429 at capacity, 400,
    404) is raised here, anything later becomes the future's answer. The leases of this
    request's admission are held until the generation ends."""
    release = _releaser(detach_leases())
    engine = admitted.engine(ctx.engine)
    starting = asyncio.ensure_future(start_all(engine, ts.engine_requests(
        future.request_id, plan, resolved, admitted.weight)))
    try:
        await asyncio.wait({starting}, timeout=ADMIT_WAIT_S)
        if starting.done() and starting.exception() is not None:
            raise starting.exception()
    except BaseException:
        starting.cancel()
        release()
        raise
    future.task = asyncio.create_task(_run(futures, future, engine, plan, resolved,
                                           admitted.weight, starting, ctx,
                                           sv.RequestClock(ctx.metrics), release))


async def _run(futures: FutureStore, future: Future, engine: Any, plan: ts.SamplePlan,
               resolved: ResolvedModel, weight: float, starting: Any, ctx: sv.ServerContext,
               clock: sv.RequestClock, release: Callable[[], None]) -> None:
    """Generate, then set the future's answer (a SampleResponse or an error)."""
    def at_capacity() -> None:
        future.queue_state = "paused_capacity"

    try:
        seqs, prompt_lps = await ts.generate(engine, future.request_id, plan, resolved, weight,
                                             starting, at_capacity, clock.first_output)
        ctx.metrics.prompt_tokens.inc(len(plan.prompt.token_ids))
        ctx.metrics.generation_tokens.inc(sum(len(s.tokens) for s in seqs))
        answer = ts.sample_response(plan, seqs, prompt_lps)
    except asyncio.CancelledError:
        futures.finish(future, {"error": "the server stopped before this request finished; "
                                "sample again", "category": "server"})
        raise
    except Exception as exc:  # the future's answer: the SDK raises it as RequestFailedError
        answer = ts.failure(exc)
    finally:
        release()
        clock.finished()
    futures.finish(future, answer)


def _releaser(leases: list) -> Callable[[], None]:
    def release() -> None:
        for lease in leases:
            lease.release()

    return release


async def long_poll(future: Future, request: Request) -> None:
    """Wait until the future has its answer, LONG_POLL_S passes or the client goes away."""
    finished = asyncio.ensure_future(future.finished.wait())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({finished, gone}, timeout=LONG_POLL_S,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished.cancel()
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
