"""How `loraserve serve --replicas N` lays the server out on Ray Serve, and its command-line
options (no Ray import here: `loraserve` without --replicas never imports Ray)."""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

from loraserve.engine.config import EngineConfig

APP_NAME = "loraserve"
INGRESS_DEPLOYMENT = "LoraServeIngress"
REPLICA_DEPLOYMENT = "LoraServeEngine"

# the engine deployment's request router: `affinity` (router.AffinityRouter: rendezvous hashing
# with bounded loads, held adapters first, routing.py) or `multiplex` (Serve's default: power of two choices among
# the replicas that reported holding the adapter, kept to compare against)
ROUTING = ("affinity", "multiplex")


@dataclass(slots=True)
class ScaleOutConfig:
    """The Ray side of a scaled-out server; the engines' own settings stay in EngineConfig.

    `replicas` engine replicas (>= 2; one engine is plain `loraserve serve`) each reserve
    `replica_cpus` CPUs and `replica_gpus` GPUs (None: 1 when the engine runs on CUDA, else 0).
    `ray_address` joins that Ray cluster; None starts a local Ray with `num_cpus` CPUs (None: all
    the machine's) and stops it with the server. Replicas report their engine snapshot to the
    ingress every `report_interval_s`; one silent for `stale_after_s` is gone from /metrics.
    """

    replicas: int
    ray_address: str | None = None
    num_cpus: int | None = None
    replica_cpus: float = 1.0
    replica_gpus: float | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = APP_NAME
    report_interval_s: float = 0.5
    stale_after_s: float = 5.0
    object_store_mb: int | None = None  # local Ray's object store; None: Ray's default
    routing: str = "affinity"   # ROUTING: the engine deployment's Serve request router
    load_bound_c: float = 1.25  # affinity: a replica takes no request past c x the mean load
    # each replica supervises its engine-core process as `serve` does (`--engine-timeout`,
    # `--engine-start-timeout`): no progress this long and the core is replaced
    engine_timeout_s: float = 30.0
    engine_start_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}, got {self.routing!r}")
        if not self.load_bound_c >= 1:
            raise ValueError(f"the load bound's c must be >= 1, got {self.load_bound_c}")
        if self.replicas < 2:
            raise ValueError(f"--replicas must be >= 2 (one engine is plain `loraserve serve`), "
                             f"got {self.replicas}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {self.num_cpus}")
        if self.num_cpus is not None and self.ray_address is not None:
            raise ValueError("num_cpus sizes a local Ray; it cannot be given with --ray-address")
        if self.replica_cpus < 0 or (self.replica_gpus or 0) < 0:
            raise ValueError("replica_cpus and replica_gpus must be >= 0")
        if not self.engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s must be > 0, got {self.engine_timeout_s}")
        if not 0 < self.report_interval_s < self.stale_after_s:
            raise ValueError("need 0 < report_interval_s < stale_after_s")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.object_store_mb is not None and self.object_store_mb < 64:
            raise ValueError("object_store_mb must be >= 64")
        if self.object_store_mb is not None and self.ray_address is not None:
            raise ValueError("object_store_mb sizes a local Ray; it cannot be given with "
                             "--ray-address")

    def gpus_per_replica(self, cfg: EngineConfig) -> float:
        """`replica_gpus`, or 1 when the engine will run on CUDA (device cuda, or auto on a
        machine whose torch sees a GPU), else 0."""
        if self.replica_gpus is not None:
            return self.replica_gpus
        if cfg.device.startswith("cuda"):
            return 1.0
        if cfg.device == "auto":
            import torch
            return 1.0 if torch.cuda.is_available() else 0.0
        return 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s scale-out options."""
    g = p.add_argument_group("scale out on Ray Serve (needs the extra: pip install 'loraserve[ray]')")
    g.add_argument("--replicas", type=int, metavar="N",
                   help="serve with N >= 2 engine replicas on Ray Serve behind one ingress, requests "
                        "routed to the replicas holding their adapter (default: one engine, no Ray)")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster (HEAD_IP:6379, or auto on a cluster node; default: "
                        "start a local Ray and stop it with the server)")
    g.add_argument("--ray-num-cpus", type=int, metavar="N",
                   help="CPUs of the local Ray (default: all of this machine's)")
    g.add_argument("--ray-object-store-mb", type=int, metavar="MB",
                   help="object store of the local Ray, MiB (default: Ray's, 30%% of memory)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs each engine replica reserves (default: 1)")
    g.add_argument("--replica-routing", choices=ROUTING,
                   help="how requests pick a replica: affinity (a replica holding the adapter "
                        "first; else the adapter's rendezvous-hash choices, placed past the load "
                        "bound only over it) or multiplex (Ray Serve's default multiplexed "
                        "routing) (default: affinity)")
    g.add_argument("--load-bound", type=float, metavar="C",
                   help="affinity: an adapter held nowhere is not placed on a replica past C x "
                        "the mean load while one of its first two choices is under it "
                        "(default: 1.25)")
    g.add_argument("--replica-gpus", type=float,
                   help="GPUs each engine replica reserves (default: 1 when the engine runs on "
                        "CUDA, else 0)")


def from_args(args: argparse.Namespace) -> ScaleOutConfig | None:
    """The ScaleOutConfig `serve`'s options ask for; None without --replicas (ValueError for
    bad values, before anything loads)."""
    if args.replicas is None:
        for flag in ("ray_address", "ray_num_cpus", "ray_object_store_mb", "replica_gpus",
                     "replica_routing", "load_bound"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --replicas")
        return None
    if args.single_process:
        raise ValueError("--replicas and --single-process exclude each other")
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--replicas serves on Ray Serve, which is not installed: "
                         "pip install 'loraserve[ray]'")
    return ScaleOutConfig(replicas=args.replicas, ray_address=args.ray_address,
                          num_cpus=args.ray_num_cpus, replica_cpus=args.replica_cpus,
                          replica_gpus=args.replica_gpus, host=args.host, port=args.port,
                          object_store_mb=args.ray_object_store_mb,
                          routing=args.replica_routing or "affinity",
                          load_bound_c=1.25 if args.load_bound is None else args.load_bound,
                          engine_timeout_s=args.engine_timeout,
                          engine_start_timeout_s=args.engine_start_timeout)
