"""The Tinker/MinT SDK's sampling API under /api/v1: unchanged SDK code samples from loraserve.

The SDK (`mint` / `tinker`) logs in (client/config, auth/token: a JWT standing for the API key,
tokens.py), opens a session, creates a sampling session per sampling client, and samples through
futures: `asample` answers a request id at once and `retrieve_future` long-polls for the result.

- A sampling session pins the revision its model resolved to when it was created (the promoted
  one, unless the name gives one): a revision promoted later does not change what an existing
  sampling client samples. An unknown or hidden adapter is a 404 there, which the SDK raises.
- `asample` is de-duplicated on (sampling_session_id, seq_id), so a client retry never starts a
  second generation; over the engine's or the key's capacity it answers 429, which the SDK
  backs off from quietly.
- `retrieve_future` holds the call up to LONG_POLL_S (asample.py), then answers try_again; 410 for an id
  unknown, expired (answers are kept FutureStore.keep_s after they finish) or another key's.
- Training (create_model, forward_backward, optim_step, save_weights_for_sampler, ...) is
  training.py's. Routes of the SDK this server lacks answer 400 with a JSON body saying so
  (never a 5xx, which the SDK would retry for minutes).
Names: `tinker://tenant/name[@rev]` and catalog aliases (names.py). Auth, tenants, limits and
metrics apply as on /v1. State lives on the event loop (state.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from loraserve.keys import KeyStore
from loraserve.server.tinker import asample as ta
from loraserve.server.tinker import sampling as ts
from loraserve.server.errors import APIError, clip
from loraserve.server.protocol import JSONBodyRoute
from loraserve.server.tenancy import principal_of
from loraserve.server.tinker.runs import RunRegistry
from loraserve.server.tinker.state import SamplingSession, TinkerState
from loraserve.server.tinker.training import training_routes

PREFIX = "/api/v1"
# what the SDK reads at ServiceClient(): JWT login (so `sk-` keys work), plain REST over httpx
CLIENT_CONFIG = {"pjwt_auth_enabled": True, "credential_default_source": "api_key",
                 "grpc_target": None, "enable_grpc_retrieve_future": False,
                 "use_pyqwest_transport": False, "sample_no_retries": False}
# routes of the SDK this server does not have (checkpoint archives and publishing, sessions and
# audit listings, MinT's extra losses): a 400 saying so, never a 5xx the SDK would retry
UNSUPPORTED_ROUTES = ("/audit", "/checkpoints", "/checkpoints/{rest:path}", "/sessions",
                      "/sessions/{rest:path}", "/training_runs/{model_id}/checkpoints/{rest:path}",
                      "/mint/forward_backward_reverse_kl", "/mint/checkpoints/interpolate")


class Lenient(BaseModel):
    """A body of the SDK's side traffic: unknown fields ignored, nothing required."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class HeartbeatBody(Lenient):
    session_id: str | None = None


class SamplingSessionBody(Lenient):
    session_id: str | None = None
    sampling_session_seq_id: int | None = None
    model_path: str | None = None
    base_model: str | None = None


class RetrieveBody(Lenient):
    request_id: str
    allow_metadata_only: bool = False


# -- routes --------------------------------------------------------------------------------------

def tinker_router() -> APIRouter:
    router = APIRouter(prefix=PREFIX, route_class=JSONBodyRoute, include_in_schema=False)
    _login_routes(router)
    _sampling_routes(router)
    training_routes(router)
    for path in UNSUPPORTED_ROUTES:
        router.add_api_route(path, unsupported, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    return router


def _login_routes(router: APIRouter) -> None:
    @router.post("/client/config")
    async def client_config() -> dict:
        return CLIENT_CONFIG

    @router.post("/auth/token")
    async def auth_token(request: Request) -> dict:
        """A JWT standing for the key this request presented (or for everyone, without keys)."""
        tenancy = getattr(request.app.state, "tenancy", None)
        if tenancy is None:  # an app without keys
            return {"jwt": ta.state_of(request).tokens.mint(principal_of(request), KeyStore())}
        return {"jwt": tenancy.tokens.mint(principal_of(request), tenancy.keys)}

    @router.post("/create_session")
    async def create_session(request: Request) -> dict:
        session_id = ta.new_id("sess")
        ta.state_of(request).sessions.put(session_id, ta.owner_of(request))
        return {"type": "create_session", "session_id": session_id}

    @router.post("/session_heartbeat")
    async def session_heartbeat(body: HeartbeatBody, request: Request) -> dict:
        if body.session_id:
            ta.state_of(request).sessions.put(body.session_id, ta.owner_of(request))
        return {"type": "session_heartbeat"}

    @router.post("/telemetry")
    async def telemetry() -> dict:
        """The SDK's telemetry: accepted and dropped (any other answer makes it retry forever)."""
        return {"status": "accepted"}

    @router.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        engine = ta.ctx_of(request).engine
        return {"supported_models": [{"model_name": ta.base_model_name(engine),
                                      "max_context_length": engine.max_model_len}]}


async def unsupported(request: Request) -> None:
    raise APIError(400, f"{clip(request.url.path)} is not supported by this server (loraserve): "
                   "it trains (create_model, forward_backward, optim_step, save_weights*, "
                   "load_weights, training_runs) and samples, nothing more",
                   code="not_supported")


def _sampling_routes(router: APIRouter) -> None:
    @router.post("/create_sampling_session")
    async def create_sampling_session(body: SamplingSessionBody, request: Request) -> dict:
        """Resolve the model now and pin its revision for the sampling session's life."""
        name = body.model_path or body.base_model
        if not name:
            raise APIError(400, "model_path or base_model is required", param="model_path")
        adapter = await ta.pin(name, request)
        session = SamplingSession(ta.new_id("samp"), ta.owner_of(request), adapter,
                                  body.model_path, body.base_model)
        ta.state_of(request).samplers.put(session.id, session)
        return {"type": "create_sampling_session", "sampling_session_id": session.id}

    @router.get("/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> dict:
        session = ta.sampling_session(request, sampler_id)
        model_path = session.model_path or (f"tinker://{session.adapter}" if session.adapter
                                            else None)
        engine = ta.ctx_of(request).engine
        return {"sampler_id": session.id, "base_model": ta.base_model_name(engine),
                "model_path": model_path}

    @router.post("/asample")
    async def asample(body: ts.SampleBody, request: Request) -> dict:
        return {"request_id": (await ta.start_sample(body, request)).request_id, "model_id": None}

    @router.post("/retrieve_future")
    async def retrieve_future(body: RetrieveBody, request: Request) -> dict:
        future = ta.state_of(request).futures.get(body.request_id, ta.owner_of(request))
        if future is None:
            raise APIError(410, f"request {clip(body.request_id)} is unknown or expired "
                           "(answers are kept for a few minutes)", code="future_gone")
        if future.answer is None:
            await ta.long_poll(future, request)
        if future.answer is not None:
            return future.answer
        return {"type": "try_again", "request_id": future.request_id,
                "queue_state": future.queue_state}


# -- wiring --------------------------------------------------------------------------------------

def install_tinker(app: FastAPI) -> TinkerState:
    """Serve the Tinker SDK routes on `app` (built by build_app: `app.state.ctx` set); futures
    still running when the app stops end with an error answer."""
    config = app.state.ctx.engine.config  # None: a test double without one
    kept = getattr(config, "train_state_dir", None)  # the operator's: kept after exit
    state_dir = kept or tempfile.mkdtemp(prefix="loraserve-train-")  # ours: removed at exit
    state = TinkerState(runs=RunRegistry(Path(state_dir)))
    app.state.tinker = state
    app.include_router(tinker_router())
    lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan_with_futures(app: Any) -> AsyncIterator[Any]:
        async with lifespan(app) as inner:
            try:
                yield inner
            finally:  # before the engine stops
                await asyncio.gather(*state.futures.cancel_all(), return_exceptions=True)
                if not kept:
                    shutil.rmtree(state_dir, ignore_errors=True)

    app.router.lifespan_context = lifespan_with_futures
    return state
