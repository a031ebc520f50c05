"""What the Ray Serve tests share (tests/test_ray_*.py, tests/engine/test_every_hosting.py)."""
from __future__ import annotations

import contextlib

import httpx


def ready(url: str) -> bool:
    """Whether the server at `url` answers /ready with 200 (not up yet, or not ready: False)."""
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def replica_cores() -> list:
    """The engine-core processes of the engine replicas (psutil.Process each): each replica
    hosts the process transport, so its core is a multiprocessing child of the replica's actor
    process."""
    import psutil  # Ray's dependency

    from loraserve.ray_serve.config import REPLICA_DEPLOYMENT

    cores = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            parent = p.parent()
            if ("spawn_main" in " ".join(p.cmdline()) and parent is not None
                    and REPLICA_DEPLOYMENT in " ".join(parent.cmdline())):
                cores.append(p)
    return cores
