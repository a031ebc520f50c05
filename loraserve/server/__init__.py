"""loraserve's OpenAI-compatible HTTP server (FastAPI + uvicorn).

The names below are loaded on first use (PEP 562): a process that needs one light module of this
package (a grammar worker's forkserver imports `grammar_worker`, `errors`, `tool_calls`) does not
pay for the app, FastAPI and the catalog (~2.8 s of CPU), on a machine where that CPU is taken
from the decode running beside it.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "API_KEY_ENV": "loraserve.server.app",
    "build_app": "loraserve.server.app",
    "run_server": "loraserve.server.app",
    "APIError": "loraserve.server.errors",
    "ServerMetrics": "loraserve.server.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
