"""Pure ASGI middleware (streaming-safe): body size limit and per-status counting (keys and
tenants: tenancy.py)."""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.server.errors import APIError, BodyError
from loraserve.server.metrics import ServerMetrics

API_PREFIX = "/v1"
# the API's prefixes: OpenAI's, the same under Tinker's /oai/api/v1, and the Tinker SDK's
API_PREFIXES = (API_PREFIX, "/oai/", "/api/v1/")


def _is_api(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith(API_PREFIXES)


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts "
                    f"({max_bytes} bytes; see --max-request-bytes)", code="request_too_large",
                    headers={"Connection": "close"})  # the rest of the body is left unread


class BodyTooLarge(BodyError):
    """Raised by the wrapped `receive` once a body has streamed past the limit."""


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, before anything parses them.

    A declared Content-Length over the limit is answered without reading the body into memory;
    otherwise the streamed body is counted as the app reads it, and the read that crosses the
    limit raises BodyTooLarge (FastAPI passes it to the error handlers: a 413; an app that lets it
    escape gets the 413 from here). Nothing over the limit is ever buffered.

    Before the 413 the rest of the body is read and dropped, up to `linger_bytes` more (what
    nginx's lingering close does): a server that closes with unread data makes the kernel reset
    the connection, and the client, still sending, sees a reset instead of the 413. A client that
    asked `Expect: 100-continue` has sent nothing yet and gets the 413 at once.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, linger_bytes: int | None = None):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.linger_bytes = 4 * max_bytes if linger_bytes is None else linger_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        linger = 0 if headers.get(b"expect", b"").lower() == b"100-continue" else self.linger_bytes
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                length = -1
            if length < 0:  # uvicorn refuses these itself; be safe behind another server
                error = APIError(400, "invalid Content-Length header")
                await _send_json(send, 400, error.body(), close=True)
                return
            if length > self.max_bytes:
                if length <= self.max_bytes + linger:
                    await _discard_body(receive, length)
                await _send_json(send, 413, too_large(self.max_bytes).body(), close=True)
                return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if message.get("more_body", False):
                        await _discard_body(receive, linger)
                    raise BodyTooLarge(too_large(self.max_bytes))
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await _send_json(send, 413, exc.error.body(), close=True)


async def _discard_body(receive: Receive, budget: int) -> None:
    """Read and drop what is left of a request body, at most `budget` bytes (then stop)."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


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


async def _send_json(send: Send, status: int, body: dict, close: bool = False) -> None:
    """Answer `body` as JSON; `close` ends the connection after it (a body left unread)."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
