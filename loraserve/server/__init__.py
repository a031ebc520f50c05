"""loraserve's OpenAI-compatible HTTP server (FastAPI + uvicorn)."""
from loraserve.server.app import API_KEY_ENV, build_app, run_server
from loraserve.server.errors import APIError
from loraserve.server.metrics import ServerMetrics

__all__ = ["API_KEY_ENV", "APIError", "ServerMetrics", "build_app", "run_server"]
