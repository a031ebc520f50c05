"""The ingress deployment: the server's FastAPI app (`build_app`, unchanged) over an
`EngineClient` whose transport is a `RayTransport`, plus the replica header and per-replica engine gauges.

Every response carries `x-loraserve-replica`: the engine replica(s) that served it (comma-
separated when a request's sequences went to several), or `ingress` when no engine replica was
involved (an error found before any was asked, /metrics, /health, listings).

On shutdown, `launch` drains the ingress first (`drain`, `hurry`: drain.Drain) and only then
deletes the application.
"""
from __future__ import annotations

import dataclasses

from fastapi import FastAPI
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.config import EngineConfig
from ..server.app import build_app
from ..server.config import ServerConfig
from ..server.router_metrics import labelled_snapshots, label_names
from .config import ScaleOutConfig
from .drain import Drain, DrainGate
from ..engine.client.admission import Admission
from ..engine.client.frontend import EngineClient
from .frontend import RayTransport, served_by
from .routing import in_flight, routable

REPLICA_HEADER = "x-loraserve-replica"
NO_REPLICA = "ingress"

# the per-engine gauges of ServerMetrics (one engine's, unlabelled) -> (name, documentation,
# EngineSnapshot attribute); behind the ingress they come per replica instead
_ENGINE_GAUGES = {"running": ("loraserve_running_requests", "Requests running in the engine", "running"),
                  "waiting": ("loraserve_waiting_requests", "Requests waiting for admission", "waiting"),
                  "batch_size": ("loraserve_batch_size", "Sequences in the last engine step", "batch_size"),
                  "kv_usage": ("loraserve_kv_cache_usage", "Fraction of KV cache blocks in use", "kv_usage"),
                  "prefix_hit_rate": ("loraserve_prefix_cache_hit_rate", "Prompt tokens found in the "
                                      "prefix cache / looked up, since start", "prefix_cache_hit_rate")}


class ReplicaHeaderMiddleware:
    """Pure ASGI: set `x-loraserve-replica` on every response from the replicas the request's
    engine calls went to (frontend.served_by, filled as their streams open)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replicas: set[str] = set()
        token = served_by.set(replicas)

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REPLICA_HEADER] = ",".join(sorted(replicas)) or NO_REPLICA
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            served_by.reset(token)


class ReplicaEngineGauges(Collector):
    """ServerMetrics' engine gauges, one series per engine replica (label `replica`)."""

    def __init__(self, frontend: EngineClient):
        self.frontend = frontend

    def collect(self):
        snaps = labelled_snapshots(self.frontend)
        extra = label_names(snaps) or ["replica"]
        for name, doc, attr in _ENGINE_GAUGES.values():
            m = GaugeMetricFamily(name, doc, labels=extra)
            for labels, snap in snaps:
                m.add_metric(list(labels.values()), float(getattr(snap, attr)))
            yield m
        yield router_gauge()
        yield routable_gauge()
        yield fair_gauge(self.frontend.admission)


def router_gauge() -> GaugeMetricFamily:
    """The affinity router's view: per replica, the requests it sent that have not completed
    (what its load bound counts; none under `--replica-routing multiplex`)."""
    m = GaugeMetricFamily("loraserve_router_in_flight", "Requests the ingress's router sent to "
                          "an engine replica that have not completed", labels=["replica"])
    for replica, count in sorted(in_flight().items()):
        m.add_metric([replica], float(count))
    return m


def routable_gauge() -> GaugeMetricFamily:
    """1 for each engine replica the ingress's router can send requests to now (none under
    `--replica-routing multiplex`)."""
    m = GaugeMetricFamily("loraserve_router_replicas", "Engine replicas the ingress's router "
                          "routes to now (1 each)", labels=["replica"])
    for replica in sorted(routable()):
        m.add_metric([replica], 1.0)
    return m


def fair_gauge(gate: Admission) -> GaugeMetricFamily:
    """Sequences waiting at the ingress for a running slot (client.admission), per tenant."""
    m = GaugeMetricFamily("loraserve_fair_share_waiting", "Sequences waiting at the ingress "
                          "for a running slot in the cluster", labels=["tenant"])
    for tenant, queue in sorted(gate.waiting.items()):
        m.add_metric([tenant], float(len(queue)))
    return m


def ingress_app(frontend: EngineClient, options: ServerConfig) -> FastAPI:
    """The single process's app over `frontend`, with per-replica engine gauges on /metrics,
    the replica header on every response, and its drain (`app.state.drain`)."""
    # Serve's proxy sets X-Request-Id on the request (the client's, else its own) and echoes it:
    # the app logs that id and adds no second header
    app = build_app(frontend, dataclasses.replace(options, echo_request_id=False))
    metrics = app.state.ctx.metrics
    for attr in _ENGINE_GAUGES:
        metrics.registry.unregister(getattr(metrics, attr))
    metrics.register(ReplicaEngineGauges(frontend))
    app.state.drain = Drain(app.state.ctx.deadline)
    app.add_middleware(DrainGate, drain=app.state.drain)
    app.add_middleware(ReplicaHeaderMiddleware)  # outermost: a drain's 503 carries it too
    return app


@serve.ingress()
class Ingress:
    """The HTTP entry (one replica): routes, auth and tenants as in the single process."""

    def __init__(self, replicas: DeploymentHandle, engine_config: dict, scale: ScaleOutConfig,
                 options: ServerConfig):
        self.transport = RayTransport(EngineConfig(**engine_config), replicas, scale)
        self.frontend = EngineClient(self.transport)
        self._loraserve_app = ingress_app(self.frontend, options)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._loraserve_app

    async def report(self, replica_id: str, snapshot: dict, seen: int, results: dict) -> list:
        """An engine replica's periodic report (board.ReplicaBoard.report); its resident
        adapters' use is noted for /v1/residency's `top` at each one."""
        commands = self.transport.report(replica_id, snapshot, seen, results)
        snap = self.transport.board.live().get(replica_id)
        if snap is not None:
            self._loraserve_app.state.residency.observe(replica_id, snap)
        return commands

    async def drain(self, timeout_s: float, flush_s: float) -> dict:
        """Shutdown's first step (drain.Drain.run): new requests 503, those in flight run on
        for up to timeout_s, then end with a clean error; what it did."""
        return (await self._loraserve_app.state.drain.run(timeout_s, flush_s)).as_dict()

    async def hurry(self) -> None:
        """A second signal: the drain ends the requests in flight now."""
        self._loraserve_app.state.drain.hurry()
