"""The ingress's drain: what the single-process server's shutdown does (server/app.py,
DrainingServer), done inside the ingress replica, since Serve's proxy, not uvicorn, holds the
socket.

`Drain.run` (called by `launch` on SIGTERM/SIGINT, through the ingress's handle): from then on
/ready answers 503 and every new request 503 `server_shutting_down` (/health still 200: the
process is alive, and a liveness probe must not restart it mid-drain); the requests in flight
run on until they end or `timeout_s` (the server's --shutdown-timeout) passes, or `hurry()` (a
second signal) comes; then the app's ShutdownDeadline ends those left with a clean error (a 503
body, or an error event and [DONE] in a stream), and they get `flush_s` to send it.

No Ray import here. Event loop only (the ingress replica's): no locks.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from ..server.errors import APIError
from ..server.streaming import ShutdownDeadline

POLL_S = 0.05
# what a draining server still answers (the app's own answer: /ready says 503 by itself)
PASS_WHILE_DRAINING = frozenset({"/health", "/ready", "/metrics"})


def shutting_down_now() -> APIError:
    return APIError(503, "The server is shutting down and takes no new requests; retry it",
                    code="server_shutting_down")


@dataclass(slots=True)
class DrainReport:
    """What a drain did: requests that finished on their own, those the deadline (or a second
    signal) ended with a clean error, those still running after the flush, the time taken."""

    finished: int = 0
    cut: int = 0
    left: int = 0
    seconds: float = 0.0
    hurried: bool = False

    def as_dict(self) -> dict:
        return {"finished": self.finished, "cut": self.cut, "left": self.left,
                "seconds": round(self.seconds, 3), "hurried": self.hurried}


class Drain:
    """Counts the HTTP requests in flight (DrainGate), turns new ones away once draining."""

    def __init__(self, deadline: ShutdownDeadline):
        self.deadline = deadline
        self.in_flight = 0
        self.draining = False
        self.refused = 0  # requests answered 503 while draining
        self._hurry = False

    def hurry(self) -> None:
        """A second signal: end the requests still in flight now (with a clean error)."""
        self._hurry = True

    async def run(self, timeout_s: float, flush_s: float) -> DrainReport:
        t0 = time.monotonic()
        self.draining = True
        self.deadline.draining = True  # /ready: 503
        at_start = self.in_flight
        deadline = t0 + timeout_s
        while self.in_flight and not self._hurry and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        report = DrainReport(hurried=self._hurry)
        if self.in_flight:
            report.cut = self.in_flight
            self.deadline.expire()  # each ends with a 503, or an error event and [DONE]
            flush_end = time.monotonic() + flush_s
            while self.in_flight and time.monotonic() < flush_end:
                await asyncio.sleep(POLL_S)
        report.left = self.in_flight
        report.finished = max(0, at_start - report.cut)
        report.seconds = time.monotonic() - t0
        return report


class DrainGate:
    """Pure ASGI, outermost: counts requests in flight; while draining, answers new ones 503
    (but those in PASS_WHILE_DRAINING)."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope.get("path") not in PASS_WHILE_DRAINING:
            self.drain.refused += 1
            await shutting_down_now().response()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
