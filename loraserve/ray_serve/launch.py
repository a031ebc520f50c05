"""Start, run and stop a scaled-out server: Ray (local or joined), Serve's HTTP proxy, the
ingress deployment and the engine replicas.

Two callers: `loraserve serve --replicas N` (`run`: until SIGINT/SIGTERM) and tests (`start`,
then `ScaledServer.stop`).
"""
from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import HTTPOptions

from ..engine.config import EngineConfig
from .config import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT, ScaleOutConfig, ServerOptions
from .ingress import Ingress
from .replica import engine_config_dict, replica_class

log = logging.getLogger(__name__)

# requests the ingress replica may hold at once, per engine replica behind it, beyond the
# engines' own bounds (control calls, replica reports)
_INGRESS_SLACK = 64


def application(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerOptions):
    """The Serve application: the ingress bound to the engine deployment.

    Engine replicas: `max_ongoing_requests` = the engine's batch (more wait in Serve's router,
    still free to go to another replica), `max_queued_requests` = replicas x max_waiting (past
    it: 429), multiplexed capacity = the engine's device adapter slots. The ingress runs on
    this machine (it opens the catalog read-write and reads the model's tokenizer here)."""
    config = engine_config_dict(cfg)
    engine = serve.deployment(
        replica_class(cfg.max_gpu_adapters), name=REPLICA_DEPLOYMENT, num_replicas=scale.replicas,
        max_ongoing_requests=cfg.max_batch_size,
        max_queued_requests=max(1, scale.replicas * cfg.max_waiting),
        graceful_shutdown_timeout_s=cfg.shutdown_timeout,
        ray_actor_options={"num_cpus": scale.replica_cpus, "num_gpus": scale.gpus_per_replica(cfg)})
    ingress = serve.deployment(
        Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=scale.replicas * (cfg.max_batch_size + cfg.max_waiting + _INGRESS_SLACK),
        graceful_shutdown_timeout_s=cfg.shutdown_timeout,
        ray_actor_options={"num_cpus": 0,
                           "resources": {f"node:{ray.util.get_node_ip_address()}": 0.001}})
    return ingress.bind(engine.bind(config, scale), config, scale, options)


@dataclass
class ScaledServer:
    """A running scaled-out server; `stop()` takes it down (and the local Ray it started)."""

    scale: ScaleOutConfig
    owns_ray: bool

    @property
    def url(self) -> str:
        return f"http://{self.scale.host}:{self.scale.port}"

    def stop(self) -> None:
        try:
            serve.delete(self.scale.app_name)
            if self.owns_ray:
                serve.shutdown()
        finally:
            if self.owns_ray:
                ray.shutdown()


def start(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerOptions) -> ScaledServer:
    """Connect to (or start) Ray, start Serve's proxy on scale.host:port and deploy; returns
    once every replica is up."""
    owns_ray = not ray.is_initialized() and scale.ray_address is None
    if not ray.is_initialized():
        ray.init(address=scale.ray_address, num_cpus=scale.num_cpus, include_dashboard=False,
                 object_store_memory=scale.object_store_mb * 2**20 if scale.object_store_mb else None,
                 configure_logging=False)
    try:
        serve.start(http_options=HTTPOptions(host=scale.host, port=scale.port))
        serve.run(application(cfg, scale, options), name=scale.app_name, route_prefix="/")
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    log.info("serving %s with %d engine replicas at http://%s:%d", cfg.model_dir, scale.replicas,
             scale.host, scale.port)
    return ScaledServer(scale, owns_ray)


def run(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerOptions) -> None:
    """Serve until SIGINT or SIGTERM, then stop (the local Ray too)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = start(cfg, scale, options)
    try:
        stop.wait()
    finally:
        server.stop()
