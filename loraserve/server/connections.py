"""Connection bounds at the HTTP edge: enforced in the HTTP protocol, before the app (and so
before any key check) sees a byte of a request.

`loraserve serve` runs uvicorn with `GuardedHttpTools`, a subclass of uvicorn's httptools
protocol made per server by `protocol_class(limits, plan)`. Per connection it enforces:

- the head (request line and header fields, and a chunked body's trailers) at most
  `max_header_bytes` bytes and `max_headers` fields: else 431. A read is handed to uvicorn only
  as far as the head under way may still go, so an unfinished head holds at most the limit (one
  that begins in a read after the end of another request's body: at most that one read);
- a header deadline: the head must be complete `header_timeout` seconds after its first byte
  (a fresh connection: after the connect) - else 408 (nothing is sent to a connection that never
  sent a byte);
- a body deadline: the whole body must arrive `body_timeout` seconds after the head ended, else
  408 (time the server itself keeps the body waiting, reading paused while the app has not taken
  what came, does not count). It holds whether or not the app answered early (a 401 before the
  body ended: the rest is still read, and bounded the same way);
- keep-alive: an idle connection is closed `keep_alive_timeout` seconds after its last response
  (by uvicorn's own keep-alive timer, set to this limit), and the `keep_alive_requests`-th
  request on one connection is answered with `Connection: close`.

Every uvicorn method GuardedHttpTools overrides calls uvicorn's own and adds the bounds around
it; nothing of uvicorn's is copied, so no uvicorn release is pinned for it. A bound found
broken inside a parser callback (one field too many, a complete head over the size) is not raised
there (uvicorn's data_received would answer any error from the parser with its own 400): the
request is marked (`_refused`), what is left of it is withheld from the app (a head: no request
cycle is made for it), and it is answered once uvicorn's data_received has returned.

Over all connections: at most `max_connections` are open. A new one past the cap first closes up
to RECLAIM_BATCH of the oldest connections that hold no request (idle keep-alive, or silent or
stuck in their head for RECLAIM_GRACE_S), as nginx drains keep-alive connections; when none can
go, it is answered 503 and closed at once, nothing read. `plan_connections` keeps the cap and
the listen backlog under RLIMIT_NOFILE (raising the soft limit toward the hard one when that
is what it takes), so the process never runs out of descriptors: /health and the engine's own
files keep working.

The head and body deadlines are not timers: each connection keeps one `_deadline` (a
loop.time() value), and one sweep per server (a call_later chain, every `limits.tick` seconds
while connections are open) closes the ones past it, at most a tick late (a sweep that itself
runs late, the loop stalled, lets reads catch up first, once). A head or body deadline is armed
only when a read ends with the head or body unfinished, so a request that arrives in one read
(the usual case) arms none. Keep-alive is uvicorn's timer, armed per response and cancelled by
the next read as in plain uvicorn; the sweep backs it up with the same deadline, and is alone
after an answer sent before the body ended (the next read cancelled uvicorn's timer). The
per-request cost over plain uvicorn is the wrappers' calls and a few attribute writes
(bench/RESULTS.md, "Connection bounds").

A 431/408 is written, then the connection lingers: its write side is shut and what the client
still sends is read and dropped (LINGER_BYTES at most, LINGER_S at most), so that a client still
sending reads the answer instead of a reset. Invalid requests (uvicorn's 400) and Upgrades (no
WebSocket here: draining_server sets ws="none", the request is answered as plain HTTP) are
counted and logged at most every LOG_EVERY_S seconds, not once each (uvicorn's own line for each
is dropped: `_UvicornLog`).

`ConnectionCollector` exports the open connections, the cap and the closings by reason on
/metrics. Ray Serve (`--replicas`) answers HTTP from Ray's own proxy, which none of this runs in.
"""
from __future__ import annotations

import argparse
import heapq
import http
import json
import logging
import math
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loraserve.server.errors import APIError

logger = logging.getLogger("loraserve.server.connections")

KIB = 1024
FD_RESERVE = 256          # descriptors kept for everything but client connections (engine pipes,
                          # catalog shards, logs): the catalog alone opens two per shard it reads
DEFAULT_MAX_CONNECTIONS = 8192  # the cap when RLIMIT_NOFILE allows it (see plan_connections)
DEFAULT_BACKLOG = 2048    # uvicorn's listen backlog: accepted in one burst before any is checked
RECLAIM_BATCH = 32        # connections a new one past the cap closes at once (nginx: 32)
RECLAIM_GRACE_S = 1.0     # a silent or unfinished head this old may be closed for a new connection
LINGER_S = 2.0            # after a 431/408: how long what the client still sends is dropped
LINGER_BYTES = 1 << 20    # ... and how much of it
LOG_EVERY_S = 10.0        # one warning per reason per this many seconds, with the count
CHUNK_FRAMING = 64        # framing bytes allowed per chunk of a chunked body (size line, CRLFs)

# connection states (ints: compared on every request)
FRESH, HEAD, BODY, ACTIVE, IDLE, LINGER, SHED = range(7)
_INF = math.inf

# closing reasons (metric labels)
HEADER_BYTES, HEADER_COUNT, TRAILER_BYTES = "header_bytes", "header_count", "trailer_bytes"
HEADER_TIMEOUT, BODY_TIMEOUT, IDLE_TIMEOUT = "header_timeout", "body_timeout", "idle_timeout"
SILENT_TIMEOUT, RECLAIMED, OVER_CAP = "silent_timeout", "reclaimed", "over_cap"
INVALID, UPGRADE = "invalid_request", "upgrade_refused"  # counted and logged the same way
REASONS = (HEADER_BYTES, HEADER_COUNT, TRAILER_BYTES, HEADER_TIMEOUT, BODY_TIMEOUT, IDLE_TIMEOUT,
           SILENT_TIMEOUT, RECLAIMED, OVER_CAP, INVALID, UPGRADE)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The bounds `GuardedHttpTools` enforces; `serve`'s flags (`add_arguments`) set them."""

    max_header_bytes: int = field(default=64 * KIB, metadata={
        "help": "largest request head (request line and header fields; a chunked body's "
                "trailers too) in bytes; a larger one gets 431 and the connection is closed"})
    max_headers: int = field(default=100, metadata={
        "help": "most header fields in one request; more get 431"})
    header_timeout: float = field(default=10.0, metadata={
        "help": "seconds from a request's first byte (a new connection: from the connect) to "
                "the end of its head; later gets 408 and the connection is closed"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds from the end of a request's head to the end of its body, whether or "
                "not the app answered early; later gets 408 and the connection is closed"})
    max_connections: int | None = field(default=None, metadata={
        "help": "open client connections at most; past it the oldest idle ones are closed to "
                "make room, else a new one gets 503 unread. Checked against RLIMIT_NOFILE at "
                "start-up",
        "default": f"{DEFAULT_MAX_CONNECTIONS}, or fewer when RLIMIT_NOFILE is lower"})
    keep_alive_timeout: float = field(default=30.0, metadata={
        "help": "seconds an idle keep-alive connection is kept after its last response (above "
                "clients' own idle expiry, httpx's 5 s, so a reused connection is not closed "
                "under a request)"})
    keep_alive_requests: int = field(default=1000, metadata={
        "help": "requests one connection may carry; the last is answered with Connection: close"})

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "keep_alive_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be >= 1024")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")

    @property
    def tick(self) -> float:
        """Seconds between sweeps: a deadline is enforced at most this late."""
        shortest = min(self.header_timeout, self.body_timeout, self.keep_alive_timeout)
        return min(1.0, max(0.05, shortest / 8))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s connection options, one per ConnectionLimits field (help and default from it)."""
    g = p.add_argument_group("connection bounds (the HTTP edge, before any key check)")
    hints = {"max_header_bytes": int, "max_headers": int, "header_timeout": float,
             "body_timeout": float, "max_connections": int, "keep_alive_timeout": float,
             "keep_alive_requests": int}
    for f in fields(ConnectionLimits):
        shown = f.metadata.get("default", f.default)
        g.add_argument(_flag(f.name), dest=f.name, type=hints[f.name], default=f.default,
                       metavar="S" if hints[f.name] is float else "N",
                       help=f"{f.metadata['help']} (default: {shown})".replace("%", "%%"))


def from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The ConnectionLimits `serve`'s options ask for (ValueError for bad values)."""
    return ConnectionLimits(**{f.name: getattr(args, f.name) for f in fields(ConnectionLimits)})


@dataclass(frozen=True, slots=True)
class ConnectionPlan:
    """What `plan_connections` settled: the cap, uvicorn's listen backlog, RLIMIT_NOFILE."""

    max_connections: int
    backlog: int
    fd_limit: int


def plan_connections(limits: ConnectionLimits, backlog: int = DEFAULT_BACKLOG) -> ConnectionPlan:
    """The connection cap and listen backlog that fit under RLIMIT_NOFILE.

    Descriptors needed: the cap, the backlog (a burst of connections is accepted before any of
    them is checked against the cap) and FD_RESERVE for the rest of the process. The soft limit
    is raised toward the hard one when that is what it takes. An explicit `max_connections` that
    cannot fit is a ValueError; the default shrinks to what fits (the backlog too, to a quarter
    of the limit).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = (limits.max_connections or DEFAULT_MAX_CONNECTIONS) + backlog + FD_RESERVE
    if soft != resource.RLIM_INFINITY and want > soft:
        raised = want if hard == resource.RLIM_INFINITY else min(hard, want)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError):
                pass
    fd_limit = want if soft == resource.RLIM_INFINITY else soft
    backlog = max(16, min(backlog, fd_limit // 4))
    room = fd_limit - backlog - FD_RESERVE
    if limits.max_connections is not None:
        if limits.max_connections > room:
            raise ValueError(
                f"--max-connections {limits.max_connections} needs "
                f"{limits.max_connections + backlog + FD_RESERVE} file descriptors (with the "
                f"listen backlog {backlog} and {FD_RESERVE} for the rest of the server); "
                f"RLIMIT_NOFILE allows {fd_limit} (hard limit {hard}): raise it (ulimit -n) or "
                f"lower --max-connections to {max(room, 0)}")
        return ConnectionPlan(limits.max_connections, backlog, fd_limit)
    if room < 16:
        raise ValueError(f"RLIMIT_NOFILE ({fd_limit}) leaves no room for client connections "
                         f"(the server keeps {FD_RESERVE} for itself): raise it (ulimit -n)")
    return ConnectionPlan(min(DEFAULT_MAX_CONNECTIONS, room), backlog, fd_limit)


def _response(status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 answer with an OpenAI error body, closing the connection."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Guard:
    """One server's connection bookkeeping: the sweep, the cap, counts by reason."""

    def __init__(self, limits: ConnectionLimits, plan: ConnectionPlan):
        self.limits = limits
        self.max_connections = plan.max_connections
        self.tick = limits.tick
        self.connections: set | None = None  # uvicorn's server_state.connections (the first seen)
        self.lingering: set = set()  # answered and lingering: out of `connections`, still open
        self.handle: Any = None      # the next sweep
        self.due = 0.0               # when it is due
        self.skipped = False         # the last sweep ran late and expired nothing
        self.quiet_until = 0.0       # no reclaim scan before this (the last found nothing)
        self.closed = dict.fromkeys(REASONS, 0)
        self._logged: dict[str, tuple[float, int]] = {}
        h, n = limits.max_header_bytes, limits.max_headers
        self.answers = {
            HEADER_BYTES: _response(431, f"The request head is larger than this server accepts "
                                    f"({h} bytes; see --max-header-bytes)",
                                    "request_header_fields_too_large"),
            TRAILER_BYTES: _response(431, f"The request trailers are larger than this server "
                                     f"accepts ({h} bytes; see --max-header-bytes)",
                                     "request_header_fields_too_large"),
            HEADER_COUNT: _response(431, f"The request has more header fields than this server "
                                    f"accepts ({n}; see --max-headers)",
                                    "request_header_fields_too_large"),
            HEADER_TIMEOUT: _response(408, f"The request head did not arrive within "
                                      f"{limits.header_timeout:g} s (see --header-timeout)",
                                      "request_timeout"),
            BODY_TIMEOUT: _response(408, f"The request body did not arrive within "
                                    f"{limits.body_timeout:g} s of its head (see --body-timeout)",
                                    "request_timeout"),
            RECLAIMED: _response(408, "The request head was too slow while the server was at its "
                                 "connection limit", "request_timeout"),
            OVER_CAP: _response(503, "The server is at its connection limit (see "
                                "--max-connections); try again", "too_many_connections",
                                retry_after=1),
        }

    @property
    def open(self) -> int:
        return (len(self.connections) if self.connections is not None else 0) + len(self.lingering)

    def note(self, reason: str, now: float) -> None:
        """Count a closing; log it, at most once per reason every LOG_EVERY_S seconds."""
        self.closed[reason] += 1
        last, count = self._logged.get(reason, (-_INF, 0))
        if now - last >= LOG_EVERY_S:
            logger.warning("connection closed: %s (%d since the last report)", reason, count + 1)
            self._logged[reason] = (now, 0)
        else:
            self._logged[reason] = (last, count + 1)

    def watch(self, loop: Any) -> None:
        if self.handle is None:
            self._schedule(loop)

    def _schedule(self, loop: Any) -> None:
        self.due = loop.time() + self.tick
        self.handle = loop.call_later(self.tick, self.sweep, loop)

    def sweep(self, loop: Any) -> None:
        """Close the connections past their deadline; again in a tick while any is open.

        A sweep that runs more than a tick late (the loop was stalled) expires nothing, once:
        bytes that arrived meanwhile are read first, so a client is not timed out for the
        server's stall; the next sweep expires whatever is still past its deadline."""
        self.handle = None
        now = loop.time()
        if now - self.due > self.tick and not self.skipped:
            self.skipped = True
            self._schedule(loop)
            return
        self.skipped = False
        expired = [c for c in self.connections if getattr(c, "_deadline", _INF) <= now]
        expired += [c for c in self.lingering if c._deadline <= now]
        for conn in expired:
            conn._expire(now)
        if self.connections or self.lingering:
            self._schedule(loop)

    def reclaim(self, now: float) -> bool:
        """Make room for a new connection past the cap: close lingering ones, then up to
        RECLAIM_BATCH of the oldest that hold no request. False when nothing could go."""
        if self.lingering:
            for conn in list(self.lingering)[:RECLAIM_BATCH]:
                conn._close(abort=True)
            return True
        if now < self.quiet_until:
            return False
        idle = [c for c in self.connections if getattr(c, "_state", ACTIVE) == IDLE
                or (getattr(c, "_state", ACTIVE) in (FRESH, HEAD)
                    and now - c._since >= RECLAIM_GRACE_S)]
        if not idle:
            self.quiet_until = now + min(self.tick, 0.1)
            return False
        for conn in heapq.nsmallest(RECLAIM_BATCH, idle, key=lambda c: c._since):
            conn._reclaim(now)
        return True


# uvicorn's warning for each request httptools cannot parse (uvicorn answers it 400 and closes):
# GuardedHttpTools counts these and logs them at most every LOG_EVERY_S instead
_INVALID_WARNING = "Invalid HTTP request received."


class _UvicornLog:
    """uvicorn's logger ("uvicorn.error") as one connection uses it, less uvicorn's warning per
    invalid request: the Guard counts those and logs them at most every LOG_EVERY_S, so a client
    sending garbage in a loop does not write a line per request."""

    __slots__ = ("_logger",)

    def __init__(self, logger: Any):
        self._logger = logger

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if msg != _INVALID_WARNING:
            self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of `guard.limits` (see the module's doc).

    Made per server by `protocol_class`; uvicorn constructs one per connection. Each uvicorn
    method overridden here calls uvicorn's own for what uvicorn does and adds the bounds around
    it; a request over a bound is marked in the parser callbacks (`_refused`), withheld from the
    app, and answered once uvicorn's data_received has returned. The methods run per request
    call uvicorn's as `HttpToolsProtocol.<name>(self, ...)`: on Python 3.11 a zero-argument
    super() builds a super object per call, which at a dozen calls per request (one per header
    field) shows in the protocol's cost (bench/connection_bounds.py --count).
    """

    guard: ClassVar[Guard]

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = self.guard.limits
        self._max_head = limits.max_header_bytes
        self._max_headers = limits.max_headers
        self._header_timeout = limits.header_timeout
        self._body_timeout = limits.body_timeout
        self._idle_timeout = limits.keep_alive_timeout
        self._max_requests = limits.keep_alive_requests
        self._state = FRESH
        self._deadline = _INF
        self._since = 0.0
        self._refused: str | None = None  # the bound the request being parsed broke
        self._head_bytes = 0   # bytes read before this one while the head was unfinished
        self._read = 0         # the length of what uvicorn is parsing
        self._wire = 0         # bytes read while a body was unfinished
        self._body_bytes = 0   # body bytes parsed
        self._chunks = 0       # chunks of a chunked body
        self._requests = 0     # heads handed to uvicorn whole
        self.logger = _UvicornLog(self.logger)
        # uvicorn's keep-alive timer (armed when a response completes, cancelled by the next
        # read) runs our limit, not Config's whole seconds; its handler is ours (below)
        self.timeout_keep_alive = self._idle_timeout

    # -- connections -------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        guard = self.guard
        if guard.connections is None:
            guard.connections = self.connections
        now = self.loop.time()
        if guard.open >= guard.max_connections and not guard.reclaim(now):
            self.transport = transport
            self._state = SHED
            guard.note(OVER_CAP, now)
            transport.write(guard.answers[OVER_CAP])
            transport.close()
            return
        super().connection_made(transport)
        self._since = now
        self._deadline = now + self._header_timeout
        guard.watch(self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lingering.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state >= LINGER:
            self._drop(data)
            return
        if state != BODY and len(data) > self._max_head - self._head_bytes:
            self._feed_head(data)
        else:
            self._read = len(data)
            HttpToolsProtocol.data_received(self, data)  # uvicorn parses: 400 for garbage, Upgrades
        if self._refused is not None:
            self._answer(self._refused)
            return
        # a head or body that did not end in this read: count it, and arm its deadline (a
        # request read whole in one read, the usual case, never gets here)
        state = self._state
        if state == HEAD:
            self._head_bytes += len(data)
            if self._head_bytes > self._max_head:
                self._answer(HEADER_BYTES)
            elif self._deadline == _INF:
                self._arm(self._header_timeout)
        elif state == BODY:
            self._wire += len(data)
            if self._wire - self._body_bytes > 2 * self._max_head + CHUNK_FRAMING * self._chunks:
                self._answer(TRAILER_BYTES)
            elif self._deadline == _INF:
                self._arm(self._body_timeout)

    def _feed_head(self, data: bytes) -> None:
        """Hand uvicorn a read that the head under way (or beginning with it) might not end
        within its limit: first what the head may still take; the rest only if a head ended in
        that. A head still unfinished there is over the limit, and the rest is never parsed."""
        room = self._max_head - self._head_bytes
        heads = self._requests
        self._read = room
        super().data_received(data[:room])
        if self._refused is not None or self._state >= LINGER:
            return
        if self._state == HEAD and self._requests == heads:
            self._refused = HEADER_BYTES
            return
        self._read = len(data)  # a head that began in the part before is inside this read too
        super().data_received(data[room:])

    def _arm(self, timeout: float) -> None:
        now = self.loop.time()
        self._since = now
        self._deadline = now + timeout

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to what httptools cannot parse; it closes the connection. Counted and
        # logged here, at most every LOG_EVERY_S (_UvicornLog drops uvicorn's line for each)
        self.guard.note(INVALID, self.loop.time())
        super().send_400_response(msg)
        self._state = SHED
        self._deadline = _INF

    # -- parser callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._refused is not None:  # one pipelined after a refused request, in the same read
            return
        HttpToolsProtocol.on_message_begin(self)
        if self._state != FRESH:  # a first request's head is due from the connect
            self._deadline = _INF  # armed in data_received if the head does not end in this read
        self._state = HEAD

    def on_header(self, name: bytes, value: bytes) -> None:
        # a chunked body's trailers come here too (uvicorn adds them to the request's headers)
        if len(self.headers) < self._max_headers:
            HttpToolsProtocol.on_header(self, name, value)
        elif self._refused is None:
            self._refused = HEADER_COUNT

    def on_headers_complete(self) -> None:
        if self._refused is not None:  # no request for the app: answered after the read
            return
        # the head's exact size, when what was read while it lasted could be over the limit
        if self._head_bytes + self._read > self._max_head and (
                len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
                > self._max_head):
            self._refused = HEADER_BYTES
            return
        HttpToolsProtocol.on_headers_complete(self)
        self._state = BODY
        self._deadline = _INF  # armed in data_received if the body does not end in this read
        self._head_bytes = self._wire = self._body_bytes = self._chunks = 0
        self._requests += 1
        if self._requests >= self._max_requests and self.cycle is not None:
            self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._refused is None:
            HttpToolsProtocol.on_body(self, body)

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_message_complete(self) -> None:
        if self._refused is not None:
            return
        cycle = self.cycle
        HttpToolsProtocol.on_message_complete(self)
        if cycle is None:
            return
        if cycle.response_complete:  # answered before the body ended (a 401, a 413)
            self._idle()
        elif not cycle.more_body:  # the body's end handed to the app: it answers now
            self._state = ACTIVE
            self._deadline = _INF

    def on_response_complete(self) -> None:
        # uvicorn's starts a pipelined request, else (the connection kept) arms its keep-alive
        # timer: then the connection is idle
        HttpToolsProtocol.on_response_complete(self)
        if self._state == ACTIVE and self.timeout_keep_alive_task is not None:
            now = self.loop.time()
            self._state = IDLE
            self._since = now
            self._deadline = now + self._idle_timeout

    def timeout_keep_alive_handler(self) -> None:
        # uvicorn's keep-alive timer: it closes a connection still idle (a head or a body begun
        # since is under its own deadline), without waiting for what the client does not read
        if self._state == IDLE:
            self.guard.note(IDLE_TIMEOUT, self.loop.time())
            self._close()

    def _unsupported_upgrade_warning(self) -> None:
        # an Upgrade the server does not speak (draining_server serves no WebSocket): the
        # request is answered as plain HTTP; counted, logged at most every LOG_EVERY_S
        self.guard.note(UPGRADE, self.loop.time())

    def _idle(self) -> None:
        # after an answer sent before the body ended, once the body did: uvicorn's keep-alive
        # timer, armed then, was cancelled by a read since, so the sweep closes it at this deadline
        now = self.loop.time()
        self._state = IDLE
        self._since = now
        self._deadline = now + self._idle_timeout

    # -- closing -----------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """The sweep found this connection past its deadline."""
        state = self._state
        if state == HEAD:
            self._answer(HEADER_TIMEOUT)
        elif state == BODY:
            if self.flow is not None and self.flow.read_paused:  # the app's wait, not the client's
                self._deadline = now + self.guard.tick
                return
            self._answer(BODY_TIMEOUT)
        elif state == FRESH:
            self.guard.note(SILENT_TIMEOUT, now)
            self._close()
        elif state == IDLE:
            self.guard.note(IDLE_TIMEOUT, now)
            self._close()
        elif state == LINGER:
            self._close(abort=True)
        else:
            self._deadline = _INF

    def _reclaim(self, now: float) -> None:
        """Closed to make room for a new connection past the cap."""
        self.guard.note(RECLAIMED, now)
        if self._state == HEAD:
            self._answer(RECLAIMED, note=False, linger=False)
        else:
            self._close()

    def _answer(self, reason: str, note: bool = True, linger: bool = True) -> None:
        """Answer `reason`'s 431/408 and close (lingering), ending the request being read."""
        guard = self.guard
        if note:
            guard.note(reason, self.loop.time())
        cycle = self.cycle
        if self._state == HEAD and cycle is not None and not cycle.response_complete:
            # the head of a pipelined request; the one before it is still being answered: let
            # it finish, then close (what the client still sends is not parsed)
            cycle.keep_alive = False
            self.flow.pause_reading()
            self._state = SHED
            self._deadline = _INF
            return
        answered = False  # the request being read was answered already (a 401 before its body)
        if cycle is not None:
            if not cycle.response_complete:
                started = cycle.response_started
                cycle.disconnected = True  # the app's receive() says so; its sends are dropped
                cycle.message_event.set()
                if started:
                    self._close(abort=True)
                    return
            else:
                answered = self._state == BODY
        transport = self.transport
        if not answered:
            transport.write(guard.answers[reason])
        if not linger or not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()
        self._state = LINGER
        self._linger_left = LINGER_BYTES
        self._deadline = self.loop.time() + LINGER_S
        self.connections.discard(self)
        guard.lingering.add(self)
        if self.flow is not None:
            self.flow.resume_reading()

    def _drop(self, data: bytes) -> None:
        if self._state == LINGER:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self._close(abort=True)

    def _close(self, abort: bool = False) -> None:
        self._state = SHED
        self._deadline = _INF
        self.connections.discard(self)
        self.guard.lingering.discard(self)
        if abort or self.transport.get_write_buffer_size():
            self.transport.abort()  # a client that does not read cannot hold the descriptor
        else:
            self.transport.close()


def protocol_class(limits: ConnectionLimits, plan: ConnectionPlan) -> type[GuardedHttpTools]:
    """A GuardedHttpTools subclass for one server (uvicorn.Config's `http`), with its Guard."""
    return type("GuardedHttpTools", (GuardedHttpTools,), {"guard": Guard(limits, plan)})


class ConnectionCollector(Collector):
    """/metrics: open connections, the cap, and connections closed by the bounds, by reason."""

    def __init__(self, guard: Guard | None = None):
        self.guard = guard

    def collect(self) -> Iterator[Any]:
        guard = self.guard
        if guard is None:
            return
        g = GaugeMetricFamily("loraserve_http_connections", "Open client connections")
        g.add_metric([], guard.open)
        yield g
        cap = GaugeMetricFamily("loraserve_http_connections_limit",
                                "The connection cap (--max-connections)")
        cap.add_metric([], guard.max_connections)
        yield cap
        c = CounterMetricFamily("loraserve_http_connections_closed",
                                "Connections closed or refused by the connection bounds "
                                "(and Upgrades refused), by reason",
                                labels=["reason"])
        for reason, count in guard.closed.items():
            c.add_metric([reason], count)
        yield c
