"""The engine-core process's entry point, kept apart from `core` and `heartbeat`: it imports
`heartbeat` (light) at once and `core` (torch, the engine) only after the beat has started, and
neither of them imports it back."""
from __future__ import annotations

import logging
import os
import sys

from ..heartbeat import HEARTBEAT_S, Beat


def boot_core(cfg, conn, parent_pid: int, slots, heartbeat_s: float = HEARTBEAT_S) -> None:
    """Beat first, so that a core stopped while it still imports torch and builds its engine is
    found out too; then `core.run_core`. Nothing heavy is imported before the beat: it starts a
    fraction of a second after the process does. A core that served to its end exits at once
    once closed: the interpreter's exit handlers (joining torch's compile workers, after a
    background compile) took seconds without a beat, and the API server killed it meanwhile."""
    beat = Beat(slots, heartbeat_s)
    try:
        from .process import run_core
        run_core(cfg, conn, parent_pid, beat)
    finally:
        beat.stop()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
