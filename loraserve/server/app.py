"""The FastAPI app: routes, lifespan (engine start/shutdown), middleware, and `run_server`."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from loraserve.server.adapter_metrics import AdapterCollector
from loraserve.server.adapter_routes import adapter_router, catalog_cards, readiness
from loraserve.server.admin_routes import install_tenancy
from loraserve.server.chat import create_chat_completion
from loraserve.server.completions import create_completion
from loraserve.server.config import ServerConfig
from loraserve.server.connections import (ConnectionCollector, ConnectionLimits,
                                          plan_connections, protocol_class)
from loraserve.server.engine_metrics import EngineSupervisorCollector
from loraserve.server.errors import APIError, as_api_error, install_error_handlers
from loraserve.server.metrics import CONTENT_TYPE, ServerMetrics
from loraserve.heap import settle_heap
from loraserve.server.middleware import BodyLimitMiddleware, RequestMiddleware
from loraserve.server.process_metrics import CoreMemoryCollector
from loraserve.server.router_metrics import RouterMetricsCollector
from loraserve.server.residency import install_residency
from loraserve.server.protocol import ChatCompletionRequest, CompletionRequest, JSONBodyRoute
from loraserve.server.serving import Engine, ServerContext, resolve_model
from loraserve.server.tenancy import TenancyConfig, principal_of, scoped_listing, visible_ids
from loraserve.server.vllm_metrics import VllmCollector
from loraserve.server.tinker import install_tinker
from loraserve.server.tokenize import tokenize_router

API_KEY_ENV = "LORASERVE_API_KEY"
OAI_PREFIX = "/oai/api/v1"  # where Tinker's docs put its OpenAI-compatible endpoint
CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


async def _answer(request: Request, handler: Coroutine[Any, Any, Response]) -> Response:
    """Run a generation handler until it answers or the client goes away.

    A failure becomes its OpenAI error response here, so the request counter sees the real
    status (catalog errors included; a bug is a logged 500). A client that disconnects before
    the answer is ready cancels the handler, which closes (aborts) its engine requests.

    The handler runs in this task; only the disconnect watch is a task of its own, and it
    cancels this one when the client leaves (one task and an asyncio.wait per request fewer
    than running the handler beside it: bench/RESULTS.md, the hot path).
    """
    task = asyncio.current_task()
    answered = client_left = False

    def left(_: asyncio.Future) -> None:
        nonlocal client_left
        if not answered:
            client_left = True
            task.cancel()

    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(left)
    try:
        return await handler
    except asyncio.CancelledError:
        if client_left and task.uncancel() == 0:  # ours alone: the client went away
            return Response(status_code=CLIENT_CLOSED)
        raise
    except Exception as exc:
        return _error_response(exc)
    finally:
        answered = True
        gone.cancel()


def _error_response(exc: Exception) -> Response:
    """The OpenAI error response for exc; an engine error that says when to retry (no engine
    core up: `retry_after`) gets Retry-After."""
    err = as_api_error(exc)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        err.headers.setdefault("Retry-After", str(retry_after))
    return err.response()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _model_card(model_id: str, engine: Engine) -> dict:
    root = engine.model_name
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "loraserve",
            "root": root, "parent": None if model_id == root else root,
            "max_model_len": engine.max_model_len}


def _api_router(prefix: str = "/v1") -> APIRouter:
    """The OpenAI-compatible routes under `prefix` (/v1; the same under OAI_PREFIX)."""
    router = APIRouter(prefix=prefix, route_class=JSONBodyRoute)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(request, create_completion(body, _ctx(request), principal_of(request)))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(request, create_chat_completion(body, _ctx(request), principal_of(request)))

    @router.get("/models")
    async def models(request: Request, prefix: str | None = None, limit: int | None = None,
                     after: str | None = None) -> dict:
        """The base and resident adapters; with ?prefix=/?limit=, a page of the catalog."""
        engine = _ctx(request).engine
        view = engine.catalog
        if view is not None and (prefix is not None or limit is not None or after is not None):
            if limit is not None and not 1 <= limit <= 10_000:
                raise APIError(400, "limit must be in [1, 10000]", param="limit")
            try:
                cards = await asyncio.to_thread(scoped_listing(request, catalog_cards), view,
                                                prefix or "", limit or 100, after, engine.model_name)
            except Exception as exc:  # catalog errors keep their status; anything else is a 500
                raise as_api_error(exc) from exc
            return {"object": "list", "data": cards}
        ids = visible_ids(principal_of(request), engine.list_models(), engine.model_name)
        return {"object": "list", "data": [_model_card(m, engine) for m in ids]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        """The card of any name the completions routes serve for this key: resolved by the same
        resolver (the engine's AdapterDirectory: aliases, `tinker://`, the default tenant's bare
        names, revisions and tags), with the same answer for a name it does not serve (the one
        404, a 409 for another base's adapter, ...)."""
        engine = _ctx(request).engine
        try:
            await resolve_model(model_id, principal_of(request), engine)
        except Exception as exc:  # the status the completions routes answer (_error_response)
            err = as_api_error(exc)
            if getattr(exc, "retry_after", None) is not None:
                err.headers.setdefault("Retry-After", str(exc.retry_after))
            raise err from exc
        return _model_card(model_id, engine)

    @router.post("/embeddings")
    async def embeddings() -> Response:
        """Not served: one OpenAI error body saying so (not FastAPI's bare 404), so a client
        that tries the OpenAI or vLLM embeddings call learns why at once."""
        raise APIError(404, "embeddings are not served by this server: loraserve serves "
                       "completions and chat completions only (/v1/completions, "
                       "/v1/chat/completions)", code="embeddings_not_served")

    return router


def _ops_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @router.get("/ready")
    async def ready(request: Request) -> dict:
        """Readiness (/health is liveness): 503 while the server drains for shutdown, while its
        engine core is (re)starting or has missed its heartbeats (then with Retry-After), or
        naming the catalog shards that are unavailable. Ready while the CPU decode step still
        compiles in the background (it serves eagerly meanwhile): the body lists the buckets
        `compiling` (not made yet) and `compiled` (in use)."""
        ctx = _ctx(request)
        if ctx.deadline.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if not ctx.engine.ready:
            err = ctx.engine.unavailable()
            raise APIError(503, str(err), code=err.code,
                           headers={"Retry-After": str(err.retry_after)})
        if (err := await asyncio.to_thread(readiness, ctx.engine)) is not None:
            raise err
        snap = ctx.engine.snapshot
        if snap is None or not snap.compile:
            return {"status": "ready"}
        # serving already (eagerly); the decode step's graphs still being made, and those made
        return {"status": "ready", "compiling": snap.compiling(),
                "compiled": [b for b, st in snap.compile if st == "compiled"]}

    @router.get("/metrics", response_class=PlainTextResponse)  # (documents its content type)
    async def metrics(request: Request) -> Response:
        ctx = _ctx(request)
        return Response(ctx.metrics.render(ctx.engine.stats()), media_type=CONTENT_TYPE)

    return router


def resolve_api_key(api_key: str | None) -> str | None:
    """The key `--api-key` gave, else $LORASERVE_API_KEY; None (or empty) = no auth."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None


def build_app(engine: Engine, config: ServerConfig | None = None, **fields: Any) -> FastAPI:
    """The OpenAI-compatible app serving `engine`, as `config` says (a ServerConfig, else one
    made of `fields`: `build_app(engine, keys=path, max_n=4)`): `api_key` (one admin key) and
    the keys file `keys` guard it, `metrics_key` may read /metrics, `audit_log` gets
    control-plane actions (server/tenancy.py; KeyFileError for a bad keys file).

    `app.state.ctx.metrics` is the app's ServerMetrics (`register` adds collectors).
    The engine is started and shut down by the app's lifespan.
    """
    if config is None:
        config = ServerConfig(**fields)
    elif fields:
        raise TypeError(f"build_app takes a config or its fields, not both: {sorted(fields)}")
    ctx = ServerContext(engine, ServerMetrics(), config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The grammar workers first, on a thread of their own: their forkserver's import
        # (xgrammar, torch: ~4 s of CPU) overlaps the engine's boot. Started after it, it took
        # a core from the first requests' decode (SmolLM2 f32 on 2 CPUs: 98 ms a token, not 24).
        ctx.grammars.start()
        try:
            await engine.start()
        except BaseException:
            ctx.grammars.close()
            raise
        try:
            yield
        finally:
            ctx.grammars.close()
            imports = getattr(app.state, "adapter_imports", None)
            if imports is not None:
                imports.close()
            await engine.shutdown()

    app = FastAPI(title="loraserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(_api_router())
    app.include_router(_api_router(OAI_PREFIX), include_in_schema=False)  # the same handlers
    app.include_router(_ops_router())
    app.include_router(tokenize_router())  # vLLM's /tokenize and /detokenize
    install_tinker(app)
    ctx.metrics.register(VllmCollector(engine, ctx.metrics))  # vLLM's names: its Grafana dashboard
    if engine.snapshot is not None:  # vLLM's gauges, for endpoint pickers
        ctx.metrics.register(RouterMetricsCollector(engine))
        install_residency(app)  # resident adapters as bounded digests: GET /v1/residency
    if engine.catalog is not None:
        app.include_router(adapter_router())
        ctx.metrics.register(AdapterCollector(engine))
    if engine.supervision() is not None:  # an engine-core process: its memory, restarts, heartbeat
        ctx.metrics.register(CoreMemoryCollector(engine))
        ctx.metrics.register(EngineSupervisorCollector(engine))
    app.add_middleware(BodyLimitMiddleware, max_bytes=ctx.max_request_bytes)
    install_tenancy(app, TenancyConfig(api_key=config.api_key, keys_file=config.keys,
                                       metrics_key=config.metrics_key, audit_log=config.audit_log))
    app.add_middleware(RequestMiddleware, metrics=ctx.metrics,  # outermost: counts 401s
                       echo_id=config.echo_request_id)
    return app


# after the drain deadline, how long the requests it ended get to send their error before uvicorn
# cancels whatever still runs
DRAIN_FLUSH_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a drain on shutdown (SIGTERM/SIGINT).

    uvicorn stops accepting, closes idle connections and waits for the requests in flight; at
    `ctx.shutdown_timeout` the app's ShutdownDeadline ends those still running with a clean error
    (a 503 body, or an error event and [DONE] in a stream), so uvicorn's own graceful timeout
    (DRAIN_FLUSH_S later), which would tear connections, is only a backstop.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx

    async def shutdown(self, sockets: list | None = None) -> None:
        self.ctx.deadline.draining = True
        timer = asyncio.get_running_loop().call_later(self.ctx.shutdown_timeout,
                                                      self.ctx.deadline.expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def draining_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *,
                    connections: ConnectionLimits | None = None, **config: Any) -> DrainingServer:
    """A DrainingServer for an app from build_app; `config` goes to uvicorn.Config.

    HTTP is uvicorn's httptools protocol with the connection bounds of `connections` (header
    size, count and deadline, body deadline, keep-alive, the connection cap: server/connections.py;
    default: ConnectionLimits()); the cap and the listen backlog are fitted under RLIMIT_NOFILE
    here (ValueError when an explicit cap cannot fit)."""
    ctx: ServerContext = app.state.ctx
    limits = connections or ConnectionLimits()
    if "timeout_keep_alive" in config:  # uvicorn's name for it, given explicitly: it wins
        limits = dataclasses.replace(limits, keep_alive_timeout=float(config["timeout_keep_alive"]))
    plan = plan_connections(limits, config.pop("backlog", 2048))
    protocol = protocol_class(limits, plan)
    collector = getattr(app.state, "connection_collector", None)
    if collector is None:  # one per app, however many servers serve it
        collector = app.state.connection_collector = ConnectionCollector()
        ctx.metrics.register(collector)
    collector.guard = protocol.guard
    config.setdefault("http", protocol)
    config.setdefault("ws", "none")  # no WebSocket routes: an Upgrade stays plain HTTP, guarded
    # the keep-alive deadline is limits.keep_alive_timeout: the protocol sets uvicorn's own
    # timer to it per connection (GuardedHttpTools), whatever this config value says
    config.setdefault("timeout_keep_alive", max(1, math.ceil(limits.keep_alive_timeout)))
    return DrainingServer(uvicorn.Config(app, host=host, port=port, backlog=plan.backlog,
                                         timeout_graceful_shutdown=ctx.shutdown_timeout
                                         + DRAIN_FLUSH_S, **config), ctx)


def run_server(engine: Engine, config: ServerConfig | None = None, host: str = "127.0.0.1",
               port: int = 8000, *, log_level: str = "info",
               connections: ConnectionLimits | None = None, log_format: str = "text") -> None:
    """Serve `engine` with uvicorn until interrupted (draining on SIGTERM, see DrainingServer).
    `config.api_key` unset reads $LORASERVE_API_KEY; `connections` bounds the HTTP connections
    (default: ConnectionLimits(), `loraserve serve`'s defaults). With `log_format` "json"
    uvicorn leaves logging as `request_log.configure_logging` set it, so its lines are JSON too;
    uvicorn's access lines are off (the app writes one line per request)."""
    config = config or ServerConfig()
    app = build_app(engine, dataclasses.replace(config, api_key=resolve_api_key(config.api_key)))
    uvicorn_logging = {"log_config": None} if log_format == "json" else {}
    # each request's line is the app's own (server/request_log.py): uvicorn's access line, with
    # less in it, would be a second line per request
    server = draining_server(app, host=host, port=port, log_level=log_level,
                             connections=connections, access_log=False, **uvicorn_logging)
    settle_heap()  # start-up is over: freeze its heap, collect less often (loraserve.heap)
    server.run()
