"""Pure ASGI middleware (streaming-safe): body size limit; request ids, per-status counting and
the per-request log line (keys and tenants: tenancy.py)."""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.server import request_log
from loraserve.server.errors import APIError, BodyError
from loraserve.server.metrics import ServerMetrics
from loraserve.server.request_log import RequestRecord, request_id_of

API_PREFIX = "/v1"
# the API's prefixes: OpenAI's, the same under Tinker's /oai/api/v1, the Tinker SDK's, and
# vLLM's utility routes
API_PREFIXES = (API_PREFIX, "/oai/", "/api/v1/", "/tokenize", "/detokenize")


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


class RequestMiddleware:
    """Every HTTP request's id, and for the API's routes its count and its log line.

    The id (`request_log.request_id_of`: the client's X-Request-Id, else a new one) is echoed in
    the response's `X-Request-Id` header, whatever the route. An API request (OpenAI's, Tinker's,
    vLLM's /tokenize and /detokenize) is counted by status in `loraserve_requests_total{status}`
    and, once its response has ended (a stream's last byte included), writes its one line
    (`request_log.write`), which the handlers fill through `request_log.current_record()`.
    Outermost, so a 401 is counted, logged and carries the id too. `echo_id` False: the id is
    read and logged but not echoed, where a proxy in front echoes it itself (Ray Serve's: two
    headers would read as "id, id").
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, echo_id: bool = True):
        self.app = app
        self.metrics = metrics
        self.echo_id = echo_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id_of(scope["headers"]), scope["method"], scope["path"])
        scope.setdefault("state", {})["request_id"] = record.request_id
        api = _is_api(scope)
        id_header = (b"x-request-id", record.request_id.encode("ascii"))

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and record.status is None:
                record.status = message["status"]
                if self.echo_id:
                    message["headers"] = [*message.get("headers", ()), id_header]
                if api:
                    self.metrics.count_request(record.status)
            await send(message)

        token = request_log.begin(record)
        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if record.status is None and api:  # the outer error middleware answers 500
                self.metrics.count_request(500)
            record.status = record.status or 500
            raise
        finally:
            request_log.end(token)
            if api:
                record.total_s = record.since_start()
                request_log.write(record)


async def _send_json(send: Send, status: int, body: dict, close: bool = False) -> None:
    """Answer `body` as JSON; `close` ends the connection after it (a body left unread)."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
