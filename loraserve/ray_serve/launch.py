"""Start, run and stop a scaled-out server: Ray (local or joined), Serve's HTTP proxy, the
ingress deployment and the engine replicas.

Two entries: `loraserve serve --replicas N` (`run`: until SIGINT/SIGTERM, then the drain and
the stop, and the process ends) and, for a caller that owns its process, `start`, then
`ScaledServer.drain` and `ScaledServer.stop`.

`run`'s stop, in order (each step bounded, see shutdown.py):
1. drain the ingress (drain.py): new requests 503, those in flight run on for up to
   --shutdown-timeout, then end with a clean error; a second signal ends them at once;
2. a local Ray: `serve.shutdown()`, then `ray.shutdown()` (raylet, GCS ...), then every process
   still left in this process's tree (it adopted the orphans: shutdown.become_subreaper), so no
   Ray process outlives the server. A joined cluster (--ray-address): `serve.delete` of this
   server's application and a disconnect; the cluster's processes are left alone;
3. exit 0; 1 when a step overran its bound or failed, the Ray head was lost, or a third signal
   gave up the orderly stop (then a local Ray's processes are killed, and a joined cluster is
   asked to delete the application).
While serving, a lost Ray head (the local raylet or GCS server exited; a joined cluster's GCS
silent for 30 s) ends the server with status 1 instead of leaving it hanging.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NoReturn

import psutil  # Ray's dependency (ray.thirdparty_files, on sys.path once ray is imported)
import ray
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from ..engine.config import EngineConfig
from ..server.app import DRAIN_FLUSH_S
from ..server.config import ServerConfig
from .config import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT, ScaleOutConfig
from .ingress import Ingress
from .replica import replica_class
from .router import ROUTER_PATH
from .shutdown import (EXIT_FAILED, EXIT_STOPPED, HeadWatch, StopSignals, become_subreaper, bounded,
                       exit_now, kill_descendants, reap_adopted)

log = logging.getLogger(__name__)

# bounds of the stop's steps, beyond the drain's own (--shutdown-timeout + DRAIN_FLUSH_S)
DRAIN_SLACK_S = 10.0
SERVE_STOP_S = 45.0   # serve.shutdown (its controller call waits 30 s) / serve.delete
RAY_STOP_S = 30.0     # ray.shutdown: the raylet and GCS get SIGTERM, then SIGKILL
START_GRACE_S = 5.0   # a signal while starting: how long the start may still take to end
ASK_DELETE_S = 10.0   # a joined cluster given up on: the delete of the application, asked

# requests the ingress replica may hold at once, per engine replica behind it, beyond the
# engines' own bounds (control calls, replica reports)
_INGRESS_SLACK = 64


def application(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerConfig):
    """The Serve application: the ingress bound to the engine deployment.

    Engine replicas: `max_ongoing_requests` = the engine's batch (more wait in Serve's router,
    still free to go to another replica), `max_queued_requests` = replicas x max_waiting (past
    it: 429), multiplexed capacity = the engine's device adapter slots, request router =
    router.AffinityRouter (`--replica-routing affinity`) or Serve's default (`multiplex`). The
    ingress runs on this machine (it opens the catalog read-write and reads the model's
    tokenizer here)."""
    config = asdict(cfg)  # plain values: what travels to the replicas
    routing = {} if scale.routing == "multiplex" else {"request_router_config": RequestRouterConfig(
        request_router_class=ROUTER_PATH,
        request_router_kwargs={"c": scale.load_bound_c, "slots": cfg.max_gpu_adapters})}
    engine = serve.deployment(
        replica_class(cfg.max_gpu_adapters), name=REPLICA_DEPLOYMENT, num_replicas=scale.replicas,
        max_ongoing_requests=cfg.max_batch_size,
        max_queued_requests=max(1, scale.replicas * cfg.max_waiting),
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        ray_actor_options={"num_cpus": scale.replica_cpus, "num_gpus": scale.gpus_per_replica(cfg)},
        **routing)
    ingress = serve.deployment(
        Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=scale.replicas * (cfg.max_batch_size + cfg.max_waiting + _INGRESS_SLACK),
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        ray_actor_options={"num_cpus": 0,
                           "resources": {f"node:{ray.util.get_node_ip_address()}": 0.001}})
    return ingress.bind(engine.bind(config, scale), config, scale, options)


def _never() -> bool:
    return False


@dataclass
class ScaledServer:
    """A running scaled-out server; `drain()` then `stop()` take it down (and the local Ray it
    started)."""

    scale: ScaleOutConfig
    owns_ray: bool
    ingress: DeploymentHandle
    shutdown_timeout: float

    @property
    def url(self) -> str:
        return f"http://{self.scale.host}:{self.scale.port}"

    def drain(self, hurry: Callable[[], bool] = _never,
              give_up: Callable[[], bool] = _never) -> dict | None:
        """Drain the ingress (drain.Drain.run); once `hurry()` turns true, the requests still in
        flight end at once. Its report, or None when it failed or overran its bound, or
        `give_up()` turned true."""
        response = self.ingress.drain.remote(self.shutdown_timeout, DRAIN_FLUSH_S)
        bound = self.shutdown_timeout + DRAIN_FLUSH_S + DRAIN_SLACK_S
        end = time.monotonic() + bound
        hurried = False
        while True:
            try:
                return response.result(timeout_s=0.2)
            except TimeoutError:
                pass
            except Exception as exc:  # the ingress replica gone, Ray going
                log.error("the drain failed: %s", exc)
                return None
            if hurry() and not hurried:
                hurried = True
                self.ingress.hurry.remote()
            if give_up():
                return None
            if time.monotonic() > end:
                log.error("the drain did not end in %g s", bound)
                return None

    def stop(self, give_up: Callable[[], bool] = _never) -> bool:
        """stop_serve(), then stop_ray(); True when both ended in their bounds."""
        try:
            return self.stop_serve(give_up)
        finally:
            self.stop_ray(give_up)

    def stop_serve(self, give_up: Callable[[], bool] = _never) -> bool:
        """A local Ray: Serve (every application, the proxy, the controller); a joined cluster:
        this server's application alone. True when it ended in its bound."""
        if self.owns_ray:
            return bounded("serve.shutdown", serve.shutdown, SERVE_STOP_S, give_up)
        return bounded("serve.delete", lambda: serve.delete(self.scale.app_name), SERVE_STOP_S,
                       give_up)

    def stop_ray(self, give_up: Callable[[], bool] = _never) -> bool:
        """A local Ray: its processes (ray.shutdown); a joined cluster: this driver's connection
        (the cluster's processes stay). True when it ended in its bound."""
        return bounded("ray.shutdown", ray.shutdown, RAY_STOP_S, give_up)


def start(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerConfig) -> ScaledServer:
    """Connect to (or start) Ray, start Serve's proxy on scale.host:port and deploy; returns
    once every replica is up."""
    owns_ray = not ray.is_initialized() and scale.ray_address is None
    if not ray.is_initialized():
        try:
            ray.init(address=scale.ray_address, num_cpus=scale.num_cpus, include_dashboard=False,
                     object_store_memory=scale.object_store_mb * 2**20 if scale.object_store_mb
                     else None, configure_logging=False)
        except BaseException:
            if owns_ray:
                bounded("ray.shutdown", ray.shutdown, RAY_STOP_S)
            raise
    if owns_ray:
        log.info("started a local Ray (GCS at %s); it stops with the server",
                 ray.get_runtime_context().gcs_address)
    try:
        serve.start(http_options=HTTPOptions(host=scale.host, port=scale.port))
        ingress = serve.run(application(cfg, scale, options), name=scale.app_name,
                            route_prefix="/")
    except BaseException:
        if owns_ray:
            bounded("ray.shutdown", ray.shutdown, RAY_STOP_S)
        else:
            bounded("serve.delete", lambda: serve.delete(scale.app_name), SERVE_STOP_S)
        raise
    log.info("serving %s with %d engine replicas at http://%s:%d", cfg.model_dir, scale.replicas,
             scale.host, scale.port)
    return ScaledServer(scale, owns_ray, ingress, options.shutdown_timeout)


def _stop_unstarted(scale: ScaleOutConfig, owns_ray: bool, signals: StopSignals) -> NoReturn:
    """A stop signal came while the server was starting: nothing to drain; stop what started."""
    log.info("%s while starting: stopping", signals.names[0])
    status = EXIT_STOPPED
    if owns_ray:
        _stop_leftovers()
    elif not bounded("serve.delete", lambda: serve.delete(scale.app_name), SERVE_STOP_S,
                     signals.abandon.is_set):
        _ask_delete(scale)
        status = EXIT_FAILED
    exit_now(status)


def _serve_until_signal(scale: ScaleOutConfig, owns_ray: bool, signals: StopSignals,
                        watch: HeadWatch) -> None:
    """Wait for the first stop signal, reaping the orphans of a local Ray; if the cluster is lost
    meanwhile, stop what is left and end the process (EXIT_FAILED)."""
    ray_children = {p.pid for p in psutil.Process().children()}  # Ray waits for these itself
    while not signals.first.wait(0.5):
        lost = watch.lost()
        if lost is not None:
            log.error("%s: stopping what is left of the server (exit status %d)", lost,
                      EXIT_FAILED)
            if owns_ray:
                _stop_leftovers()
            else:
                _ask_delete(scale)
            exit_now(EXIT_FAILED)
        if owns_ray:
            reap_adopted(ray_children)


def run(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerConfig) -> NoReturn:
    """Serve until SIGTERM or SIGINT, drain, stop (the local Ray too) and end the process with
    its exit status (see the module's docstring); never returns. An error while starting is
    raised, after cleaning up."""
    owns_ray = scale.ray_address is None
    if owns_ray:
        become_subreaper()  # the orphans of Ray's processes stay in this process's tree
    signals = StopSignals()
    signals.install()
    server = _start_until_signal(cfg, scale, options, signals)
    if server is None:  # a signal while starting: nothing to drain
        _stop_unstarted(scale, owns_ray, signals)
    watch = _head_watch(owns_ray)
    _serve_until_signal(scale, owns_ray, signals, watch)
    log.info("%s: draining for up to %g s (send it again to end the requests in flight now)",
             signals.names[0], options.shutdown_timeout)

    def give_up() -> bool:
        return signals.abandon.is_set() or watch.lost() is not None

    report = server.drain(signals.hurry.is_set, give_up)
    if report is not None:
        log.info("drained in %.1f s (requests finished: %d, ended at the deadline: %d%s)",
                 report["seconds"], report["finished"], report["cut"],
                 ", hurried by a second signal" if report["hurried"] else "")
    serve_stopped = not give_up() and server.stop_serve(give_up)
    failure = watch.lost() or ("a third signal: the orderly stop was given up"
                               if signals.abandon.is_set() else None)
    # from here Ray goes on purpose (the head watch would see it go); a local Ray whose Serve
    # did not stop in order is killed below instead
    ray_stopped = failure is None and (serve_stopped or not owns_ray) \
        and server.stop_ray(signals.abandon.is_set)
    if owns_ray:
        _stop_leftovers()
    elif not serve_stopped:  # Serve's applications outlive their driver: ask once more
        _ask_delete(scale)
    if failure is None and signals.abandon.is_set():
        failure = "a third signal: the orderly stop was given up"
    if failure is not None:
        log.error("%s", failure)
    ok = report is not None and serve_stopped and ray_stopped and failure is None
    status = EXIT_STOPPED if ok else EXIT_FAILED
    log.info("stopped (exit status %d)", status)
    exit_now(status)


def _start_until_signal(cfg: EngineConfig, scale: ScaleOutConfig, options: ServerConfig,
                        signals: StopSignals) -> ScaledServer | None:
    """start() on a thread of its own (which then lives as long as the process), the main
    thread waiting for it or for a signal (None: a signal came first). A signal handler never
    raises into Ray's code, and ray.init, off the main thread, leaves the handlers alone. Once
    Ray is up, the handlers are put back anyway: its core worker installs a C++ failure-signal
    handler for SIGTERM. An error of start() is raised here, after cleaning up."""
    result: dict = {}
    done = threading.Event()

    def starter() -> None:
        try:
            result["server"] = start(cfg, scale, options)
        except BaseException as exc:  # raised in the main thread below
            result["error"] = exc
        finally:
            done.set()
        # Parked until the process ends: ray.init started the raylet and GCS server from this
        # thread with PR_SET_PDEATHSIG, which fires when the creating *thread* exits.
        threading.Event().wait()

    quiet = _NotMainThreadFilter()
    ray_log = logging.getLogger("ray._private.worker")
    ray_log.addFilter(quiet)
    thread = threading.Thread(target=starter, name="loraserve-start", daemon=True)
    thread.start()
    reinstalled = False
    while not done.is_set() and not signals.first.is_set():
        done.wait(0.1)
        if not reinstalled and ray.is_initialized():
            signals.install()
            reinstalled = True
    # a signal just as the application came up (its /ready may answer 200 a moment before
    # serve.run returns): let the start end, and drain
    done.wait(START_GRACE_S)
    signals.install()
    ray_log.removeFilter(quiet)
    if "server" in result:
        return result["server"]
    if "error" in result and not signals.first.is_set():
        if scale.ray_address is None:
            _stop_leftovers()
        raise result["error"]
    return None


class _NotMainThreadFilter(logging.Filter):
    """Ray's warning that ray.init off the main thread sets no SIGTERM handler: run() wants
    none from Ray (it has its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _ask_delete(scale: ScaleOutConfig) -> None:
    """A joined cluster, the orderly stop given up: ask its Serve to delete this server's
    application (it would outlive the server otherwise), waiting a little: a call not waited
    for may never leave a process that exits at once."""
    bounded("serve.delete", lambda: serve.delete(scale.app_name), ASK_DELETE_S)


def _stop_leftovers() -> None:
    """Stop every process still in this process's tree (Ray's agents and workers that outlived
    the raylet, or all of a local Ray that could not be stopped in order)."""
    stopped = kill_descendants()
    if stopped:
        log.info("stopped %d processes left by the local Ray: %s", len(stopped),
                 ", ".join(stopped[:12]))


def _head_watch(owns_ray: bool) -> HeadWatch:
    """A local Ray: this process's raylet and GCS server children; a joined cluster: its GCS."""
    if owns_ray:
        heads = {}
        for child in psutil.Process().children():
            try:
                name = child.name()
            except psutil.Error:
                continue
            if name in ("raylet", "gcs_server"):
                heads[name] = child
        if len(heads) < 2:
            log.warning("the local Ray's raylet and GCS server were not found among this "
                        "process's children (%s): they are not watched", sorted(heads))
        return HeadWatch.local(heads)
    return HeadWatch.remote(_gcs_probe)


def _gcs_probe() -> None:
    """One small GCS call (raises when the GCS does not answer in 5 s)."""
    from ray.experimental.internal_kv import internal_kv_get_gcs_client
    client = internal_kv_get_gcs_client()
    if client is None:
        raise RuntimeError("not connected to Ray")
    client.internal_kv_exists(b"loraserve-probe", b"loraserve", timeout=5)
