"""A lean HTTP/1.1 keep-alive client for load generation: asyncio protocols, httptools' parser.

A general-purpose async client (httpx) spends a few hundred microseconds of Python per request
on its layers (transport, pool, streams, headers objects); against a server on the same two cores
that is CPU the server loses, and the generator, not the server, sets the pace. Here one request
is: write a prebuilt byte string, feed the bytes that come back to httptools (C), hand each body
piece to a sink. No redirects, cookies, proxies or decompression: a load generator needs none.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

Sink = Callable[[bytes], None]


class ResponseTimeout(TimeoutError):
    """No complete response within the client's timeout (the connection is dropped)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight on it."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.sink: Sink | None = None
        self.status = 0
        self.received = False  # a byte of the current response arrived
        self.keep_alive = True
        self.closed = False
        self.idle_since = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(exc)
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.fail(exc or ConnectionResetError("the server closed the connection"))

    # -- httptools callbacks --------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self.status)

    # -- the client's side ----------------------------------------------------------------------
    def send(self, data: bytes, sink: Sink | None, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        self.waiter = loop.create_future()
        self.sink, self.status, self.received = sink, 0, False
        self.transport.write(data)
        return self.waiter

    def fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def time_out(self) -> None:
        self.fail(ResponseTimeout("no complete response in time"))
        self.transport.abort()


class HTTPClient:
    """Requests to one origin over a pool of keep-alive connections (opened on demand).

    `request(data, sink)` sends a request prebuilt by `build` and returns the status; the body
    goes to `sink` piece by piece as it arrives (chunked framing already removed), which is where
    a caller times a streamed response's first event.
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 120.0,
                 keepalive_expiry: float = 2.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        lines = [f"Host: {host}:{self.port}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._headers = "".join(f"{line}\r\n" for line in lines)
        self.timeout = timeout
        self.keepalive_expiry = keepalive_expiry  # below the server's keep-alive (uvicorn: 5 s)
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    def build(self, method: str, path: str, body: bytes = b"",
              content_type: str = "application/json") -> bytes:
        """The bytes of one request (reusable: send the same bytes again and again)."""
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._headers}"
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body

    async def request(self, data: bytes, sink: Sink | None = None) -> int:
        """Send `data` (from `build`); the response's status once its body has been read."""
        conn = self._take()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        try:
            status = await self._exchange(conn, data, sink)
        except (ConnectionError, OSError) as exc:
            conn.transport.abort()
            if not reused or conn.received or isinstance(exc, ResponseTimeout):
                raise
            # the server closed an idle connection as we reused it: once more on a new one
            conn = await self._connect()
            try:
                status = await self._exchange(conn, data, sink)
            except BaseException:
                conn.transport.abort()
                raise
        except BaseException:  # cancelled, or a parser error: the connection is in an unknown state
            conn.transport.abort()
            raise
        if conn.keep_alive and not conn.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.transport.close()
        return status

    async def _exchange(self, conn: _Connection, data: bytes, sink: Sink | None) -> int:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeout, conn.time_out)
        try:
            return await conn.send(data, sink, loop)
        finally:
            timer.cancel()

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.transport.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(
            _Connection, self.host, self.port, ssl=self.ssl,
            server_hostname=self.host if self.ssl else None), self.timeout)
        self._open = {c for c in self._open if not c.closed}
        self._open.add(conn)
        return conn

    async def aclose(self) -> None:
        for conn in self._open:
            if not conn.closed:
                conn.transport.close()
        self._idle.clear()
        self._open.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
