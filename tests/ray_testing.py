"""What the Ray Serve tests share (tests/test_ray_*.py)."""
from __future__ import annotations

import httpx


def ready(url: str) -> bool:
    """Whether the server at `url` answers /ready with 200 (not up yet, or not ready: False)."""
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
