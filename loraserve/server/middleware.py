"""Pure ASGI middleware (streaming-safe): API-key check and per-status request counting."""
from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.server.errors import APIError
from loraserve.server.metrics import ServerMetrics

API_PREFIX = "/v1"


def _is_api(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith(API_PREFIX)


class ApiKeyMiddleware:
    """Require `Authorization: Bearer <api_key>` on /v1/* as vLLM does; /health, /metrics stay open.

    The check runs before the body is read, so a client without the key learns nothing else.
    """

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_api(scope) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        await _send_json(send, 401, error.body())


class RequestCountMiddleware:
    """Count /v1 responses by status in `loraserve_requests_total{status}`."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_api(scope):
            await self.app(scope, receive, send)
            return
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.count_request(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not counted:  # the outer error middleware answers 500
                self.metrics.count_request(500)
            raise


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
