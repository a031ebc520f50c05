"""Connection bounds at the HTTP edge (server/connections.py), against a real server process:
oversized or too many headers get 431, a head or body past its deadline gets 408 and is closed,
connections past the cap are shed without reaching the fd limit, and every case is checked to
leave the server serving /health and a completion to other clients.

The server is `draining_server` (as `loraserve serve` runs it) over the fake engine in its own
process, so its descriptors and memory can be read from /proc, with small limits from the same
flags `serve` has, so that each test takes a few seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraserve.cli import build_parser
from loraserve.server.connections import (DEFAULT_MAX_CONNECTIONS, FD_RESERVE, ConnectionLimits,
                                          from_args, plan_connections)

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": "fake-base", "prompt": "ab", "max_tokens": 2}
HEAD_BYTES = 4096
MAX_HEADERS = 20
TIMEOUT = 1.0       # the tight server's header and body deadlines
SLACK = 6.0         # what "closed in time" allows beyond a deadline, on a loaded 2-core machine

SERVER_SCRIPT = """
import argparse, socket, sys
from server.fake_engine import FakeEngine
from loraserve.server import build_app
from loraserve.server.app import draining_server
from loraserve.server.connections import add_arguments, from_args
p = argparse.ArgumentParser()
add_arguments(p)
args = p.parse_args(sys.argv[1:])
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
app = build_app(FakeEngine(delay_s=0.01), api_key="%s", max_n=4)
server = draining_server(app, log_level="error", lifespan="on", connections=from_args(args))
print(sock.getsockname()[1], flush=True)
server.run(sockets=[sock])
""" % KEY


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def connect(self, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)


@contextlib.contextmanager
def serve(*flags: str) -> Iterator[Server]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, *flags], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        server = Server(proc, port)
        deadline = time.monotonic() + 60
        while True:  # the socket is bound before the server runs: wait for it to answer
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.05)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def tight() -> Iterator[Server]:
    """Small head limits and 1 s deadlines; a cap high enough not to matter here."""
    with serve("--max-header-bytes", str(HEAD_BYTES), "--max-headers", str(MAX_HEADERS),
               "--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT),
               "--keep-alive-timeout", "20", "--max-connections", "200") as server:
        yield server


CAP = 20


@pytest.fixture(scope="module")
def capped() -> Iterator[Server]:
    """A cap of CAP connections, long deadlines (only the cap acts)."""
    with serve("--max-connections", str(CAP), "--header-timeout", "30", "--body-timeout", "30",
               "--keep-alive-timeout", "30") as server:
        yield server


def settle(server: Server, fds: int) -> None:
    """Wait until the server is back to about `fds` descriptors (what a test opened is gone)."""
    deadline = time.monotonic() + SLACK
    while server.fds() > fds + 4 and time.monotonic() < deadline:
        time.sleep(0.05)


def assert_still_serving(server: Server) -> None:
    """Another client gets /health and a completion (fresh connections)."""
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=GOOD, headers=AUTH)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2


def read_answer(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """What the server sends until it closes (or `limit_s` passes): (bytes, closed)."""
    sock.settimeout(limit_s)
    data, end = b"", time.monotonic() + limit_s
    try:
        while time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return data, True
    except TimeoutError:
        return data, False
    return data, False


def complete(answer: bytes) -> bool:
    """Whether `answer` holds one whole response (head and a Content-Length body)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def read_response(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Like read_answer, but returns as soon as one whole response is in."""
    sock.settimeout(limit_s)
    data, end = b"", time.monotonic() + limit_s
    try:
        while time.monotonic() < end and not complete(data):
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return data, True
    except TimeoutError:
        pass
    return data, False


def status_of(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer[9:12])


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """sendall; False when the server has closed or reset the connection."""
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


# -- header size and count: 431 --------------------------------------------------------------------

def test_oversized_header_is_431(tight: Server) -> None:
    with tight.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (3 * HEAD_BYTES)
                     + b"\r\n\r\n")
        answer, closed = read_answer(sock, SLACK)
    assert status_of(answer) == 431 and closed, answer[:200]
    assert b"request_header_fields_too_large" in answer and b"--max-header-bytes" in answer
    assert_still_serving(tight)


def test_huge_unfinished_headers_are_cut_off_and_memory_stays_flat(tight: Server) -> None:
    """Ten connections each try to send a 64 MiB header that never ends: each is answered 431
    (or reset) after about the limit, and the server's memory does not grow by what they sent
    (what a client gets to send is the limit, what the server drops while lingering, and what
    the kernel's socket buffers take)."""
    before = tight.rss()
    results: list[tuple[int | None, bool, int]] = []

    def attack() -> None:
        with tight.connect() as sock:
            sent, piece = 0, b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 65536
            while sent < 64 << 20 and send_quietly(sock, piece):
                sent += len(piece)
                piece = b"b" * 65536
            answer, closed = read_answer(sock, SLACK)
            results.append((status_of(answer), closed, sent))

    threads = [threading.Thread(target=attack) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 10
    for status, closed, sent in results:
        assert closed and status in (431, None)  # a reset may beat the 431 to a client sending
        assert sent < 64 << 20  # cut off long before the whole header went
    assert any(status == 431 for status, _, _ in results)
    assert tight.rss() - before < 24 << 20  # not 10 x 64 MiB
    assert_still_serving(tight)


def test_too_many_headers_is_431(tight: Server) -> None:
    with tight.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n"
                     + b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS + 5)) + b"\r\n")
        answer, closed = read_answer(sock, SLACK)
    assert status_of(answer) == 431 and closed and b"--max-headers" in answer
    assert_still_serving(tight)


def test_a_flood_of_tiny_headers_is_cut_off(tight: Server) -> None:
    """Headers streamed without end (10 million offered): 431 after the first MAX_HEADERS, and
    the connection cut off after what the linger and the kernel's buffers take."""
    with tight.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        sent = 0
        while sent < 10_000_000 and send_quietly(sock, b"a: b\r\n" * 10_000):
            sent += 10_000
        answer, closed = read_answer(sock, SLACK)
    assert closed and status_of(answer) in (431, None)
    assert sent < 10_000_000
    assert_still_serving(tight)


def test_oversized_trailers_are_431_even_after_an_early_answer(tight: Server) -> None:
    """A chunked body's trailers are head bytes too, bounded the same way whether or not the app
    answered (a 401: no key) before they began."""
    with tight.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n2\r\n{}\r\n0\r\n")
        sent = 0
        while sent < 64 << 20 and send_quietly(sock, b"X-T: " + b"t" * 65536 + b"\r\n"):
            sent += 65536
        answer, closed = read_answer(sock, SLACK)
    # the 401 (no key) if the app ran before the trailers were counted, else the 431
    assert closed and status_of(answer) in (401, 431, None) and sent < 64 << 20
    assert answer.count(b"HTTP/1.1") <= 1
    assert_still_serving(tight)


# -- deadlines: 408 --------------------------------------------------------------------------------

def test_header_trickle_past_the_deadline_is_408(tight: Server) -> None:
    with tight.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        answer, closed = b"", False
        for _ in range(int((TIMEOUT + SLACK) / 0.2)):  # a byte every 0.2 s, never the end
            if not send_quietly(sock, b"X"):
                break
            sock.settimeout(0.2)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
            answer += chunk
            if not chunk or b"}" in answer:
                break
        more, closed_after = read_answer(sock, SLACK)
        elapsed = time.monotonic() - start
    assert status_of(answer + more) == 408 and b"--header-timeout" in answer + more
    assert closed or closed_after
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + SLACK
    assert_still_serving(tight)


def test_a_silent_connection_is_closed(tight: Server) -> None:
    with tight.connect() as sock:
        start = time.monotonic()
        answer, closed = read_answer(sock, TIMEOUT + SLACK)
        elapsed = time.monotonic() - start
    assert closed and answer == b"" and elapsed < TIMEOUT + SLACK
    assert_still_serving(tight)


def test_unfinished_body_with_a_valid_key_is_408(tight: Server) -> None:
    with tight.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"fake-base\", ")
        assert_still_serving(tight)  # served while the body hangs
        answer, closed = read_answer(sock, TIMEOUT + SLACK)
        elapsed = time.monotonic() - start
    assert status_of(answer) == 408 and closed and b"--body-timeout" in answer
    assert elapsed < TIMEOUT + SLACK
    assert_still_serving(tight)


def test_a_slow_body_after_an_early_401_is_closed_too(tight: Server) -> None:
    with tight.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        answer, closed = b"", False
        start = time.monotonic()
        while time.monotonic() - start < TIMEOUT + SLACK and not closed:
            if not send_quietly(sock, b" "):  # a byte every 0.1 s keeps nothing alive
                closed = True
                break
            sock.settimeout(0.1)
            try:
                chunk = sock.recv(65536)
                closed = not chunk
                answer += chunk
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
    assert status_of(answer) == 401 and closed  # one answer: the 401, then the close
    assert answer.count(b"HTTP/1.1") == 1
    assert_still_serving(tight)


# -- the connection cap ----------------------------------------------------------------------------

def hold_body(server: Server) -> socket.socket:
    """A connection whose request (with a valid key) waits for the rest of its body."""
    sock = server.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
    return sock


def test_connections_over_the_cap_are_shed_and_fds_stay_bounded(capped: Server) -> None:
    """CAP connections hold requests waiting for their bodies (a valid key: not reclaimable);
    200 more are shed at once (503 or a close, nothing read) and the server's descriptors stay
    under base + CAP; once the holders go, /health and a completion are served again."""
    base = capped.fds()
    held = [hold_body(capped) for _ in range(CAP)]
    time.sleep(0.3)
    peak, shed = 0, 0
    try:
        for _ in range(10):  # 200 more connections, in waves
            wave = []
            for _ in range(20):
                with contextlib.suppress(OSError):
                    wave.append(capped.connect(timeout=5))
            peak = max(peak, capped.fds())
            for sock in wave:
                answer, closed = read_answer(sock, SLACK)
                assert closed and status_of(answer) in (503, None)
                shed += status_of(answer) == 503
                sock.close()
        assert shed > 0
        # no room for /health either while every slot holds a request: a quick 503 or close
        try:
            assert httpx.get(f"{capped.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
    finally:
        for sock in held:
            sock.close()
    assert peak <= base + CAP + 16, (base, peak)
    settle(capped, base)
    assert_still_serving(capped)  # once they are closed, room again


def test_idle_connections_make_room_for_new_ones(capped: Server) -> None:
    """At the cap with idle keep-alive and silent connections, a new client is still served:
    the oldest idle ones are closed for it (their clients reconnect)."""
    base = capped.fds()
    idle = []
    try:
        for _ in range(CAP // 2):  # keep-alive connections after one request each
            sock = capped.connect()
            idle.append(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        idle += [capped.connect() for _ in range(CAP - len(idle))]  # silent ones
        time.sleep(1.2)  # older than the reclaim grace
        assert_still_serving(capped)
    finally:
        for sock in idle:
            sock.close()
    settle(capped, base)


# -- fuzz: random malformed, oversized, slow heads -------------------------------------------------

TOKEN = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_",
                min_size=1, max_size=12).map(str.encode)
JUNK = st.binary(min_size=0, max_size=64)
HEADER = st.one_of(
    st.tuples(TOKEN, TOKEN).map(lambda nv: nv[0] + b": " + nv[1] + b"\r\n"),
    st.tuples(TOKEN, st.integers(HEAD_BYTES // 2, 3 * HEAD_BYTES)).map(
        lambda nl: nl[0] + b": " + b"v" * nl[1] + b"\r\n"),  # big
    JUNK.map(lambda j: j + b"\r\n"),  # malformed
)
HEAD = st.builds(
    lambda method, path, version, headers, many, end: (
        method + b" " + path + b" " + version + b"\r\n" + b"".join(headers)
        + b"x: y\r\n" * many + end),
    method=st.sampled_from([b"GET", b"POST", b"PUT", b"G\x00T", b"", b"POST" * 50]),
    path=st.sampled_from([b"/v1/completions", b"/v1/models", b"/" + b"p" * (2 * HEAD_BYTES),
                          b"\x00", b"v1", b"/%zz"]),
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"", b"HTTP/1.1 junk"]),
    headers=st.lists(HEADER, max_size=6),
    many=st.sampled_from([0, 0, MAX_HEADERS + 1, 3000]),
    end=st.sampled_from([b"\r\n"] * 5 + [b"\r\n\r\n", b""]),  # b"": never finished
)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(head=HEAD, pieces=st.integers(1, 3), pause=st.sampled_from([0.0, 0.0, 0.05]))
def test_fuzzed_heads_get_a_4xx_or_a_close(tight: Server, head: bytes, pieces: int,
                                           pause: float) -> None:
    """No key is sent, so even a head that parses is a 4xx (401, 404, 405); a malformed one is
    400, a large one 431, an unfinished one 408 or a close. Never a 2xx or 5xx, never a hang."""
    start = time.monotonic()
    with tight.connect() as sock:
        size = -(-len(head) // pieces)
        for i in range(0, len(head), size):
            if not send_quietly(sock, head[i:i + size]):
                break
            time.sleep(pause)
        answer, closed = read_response(sock, TIMEOUT + SLACK)
    status = status_of(answer)
    assert status is None or 400 <= status < 500, answer[:300]
    assert closed or status is not None
    assert time.monotonic() - start < TIMEOUT + 2 * SLACK
    assert_still_serving(tight)


# -- flags and the descriptor budget ---------------------------------------------------------------

def test_serve_flags_set_the_limits() -> None:
    args = build_parser().parse_args(
        ["serve", "--max-header-bytes", "8192", "--max-headers", "50", "--header-timeout", "3",
         "--body-timeout", "7.5", "--max-connections", "100", "--keep-alive-timeout", "4",
         "--keep-alive-requests", "9"])
    assert from_args(args) == ConnectionLimits(8192, 50, 3.0, 7.5, 100, 4.0, 9)
    assert from_args(build_parser().parse_args(["serve"])) == ConnectionLimits()


def test_bad_limits_are_refused() -> None:
    for bad in ({"max_headers": 0}, {"header_timeout": 0}, {"max_header_bytes": 100},
                {"max_connections": 0}, {"body_timeout": -1}):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)


def fake_rlimit(monkeypatch: pytest.MonkeyPatch, soft: int, hard: int) -> list:
    import loraserve.server.connections as connections
    calls: list = []
    state = {"soft": soft}

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if limits[0] > hard:
            raise ValueError("over the hard limit")
        calls.append(limits)
        state["soft"] = limits[0]

    monkeypatch.setattr(connections.resource, "getrlimit", lambda which: (state["soft"], hard))
    monkeypatch.setattr(connections.resource, "setrlimit", setrlimit)
    return calls


def test_the_default_cap_fits_under_rlimit_nofile(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rlimit(monkeypatch, 1024, 1024)
    plan = plan_connections(ConnectionLimits())
    assert plan.max_connections + plan.backlog + FD_RESERVE <= 1024 and plan.max_connections > 256


def test_the_soft_limit_is_raised_when_the_hard_one_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_rlimit(monkeypatch, 1024, 1 << 20)
    plan = plan_connections(ConnectionLimits())
    assert plan.max_connections == DEFAULT_MAX_CONNECTIONS and calls
    assert plan.max_connections + plan.backlog + FD_RESERVE <= plan.fd_limit


def test_an_explicit_cap_over_the_fd_limit_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rlimit(monkeypatch, 1024, 1024)
    with pytest.raises(ValueError, match="ulimit"):
        plan_connections(ConnectionLimits(max_connections=5000))


def test_serve_checks_the_cap_before_loading_anything(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    from loraserve.cli import main
    fake_rlimit(monkeypatch, 1024, 1024)
    assert main(["serve", "--max-connections", "5000", "--model", "/nonexistent"]) == 1
    assert "--max-connections 5000" in capsys.readouterr().err


def test_websocket_upgrades_stay_plain_guarded_http(tight: Server) -> None:
    """No WebSocket routes: an Upgrade is answered as HTTP (here 200 from /health) under the
    same bounds, not handed to an unguarded WebSocket protocol."""
    with tight.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        answer, _ = read_response(sock, SLACK)
    assert status_of(answer) == 200, answer[:200]
    assert_still_serving(tight)


def test_connection_metrics(tight: Server) -> None:
    with tight.connect() as sock:  # one 431 at least
        sock.sendall(b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * (MAX_HEADERS + 1) + b"\r\n")
        read_answer(sock, SLACK)
    text = httpx.get(f"{tight.url}/metrics", headers=AUTH, timeout=10).text
    assert "loraserve_http_connections " in text
    assert "loraserve_http_connections_limit 200.0" in text
    assert 'loraserve_http_connections_closed_total{reason="header_count"}' in text
    assert 'loraserve_http_connections_closed_total{reason="invalid_request"}' in text


# -- in process: the protocol alone, on a fake transport -----------------------------------------
# GuardedHttpTools wraps uvicorn's methods (super()); these check what it adds around them, and
# that what uvicorn does itself (the answer, keep-alive's timer, its log lines) is still there

class Wire:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = self.aborted = self.eof = self.paused = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def write_eof(self) -> None:
        self.eof = True

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, key: str, default: object = None) -> object:
        return ("127.0.0.1", 1234) if key in ("peername", "sockname") else default


class Local:
    """One guarded protocol class on its own event loop, with an app that reads the whole body
    and answers 200 with how many bytes it got; `requests` counts the app's calls."""

    def __init__(self, **limits: object) -> None:
        from uvicorn.config import Config
        from uvicorn.server import ServerState

        from loraserve.server.connections import ConnectionPlan, protocol_class
        self.requests = 0

        async def app(scope: dict, receive, send) -> None:
            self.requests += 1
            got = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                got += len(message["body"])
                if not message["more_body"]:
                    break
            body = str(got).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        self.config = Config(app, lifespan="off", ws="none", log_config=None)
        self.config.load()
        self.loop = asyncio.new_event_loop()
        self.state = ServerState()
        limits = ConnectionLimits(**{"max_header_bytes": HEAD_BYTES, "max_headers": MAX_HEADERS,
                                     **limits})
        self.cls = protocol_class(limits, ConnectionPlan(100, 16, 1024))
        self.guard = self.cls.guard

    def connect(self) -> tuple[Any, Wire]:
        proto = self.cls(config=self.config, server_state=self.state, app_state={},
                         _loop=self.loop)
        wire = Wire()
        proto.connection_made(wire)
        return proto, wire

    def run(self, seconds: float = 0.0) -> None:
        """Let the app's tasks run until each has ended or waits for the client (and then
        `seconds` of timers)."""
        async def settle() -> None:
            for _ in range(100):
                await asyncio.sleep(0)
                if not self.state.tasks:
                    break
            await asyncio.sleep(seconds)
        self.loop.run_until_complete(settle())

    def close(self) -> None:
        if self.guard.handle is not None:
            self.guard.handle.cancel()
        self.loop.close()


@pytest.fixture
def local() -> Iterator[Local]:
    made: list[Local] = []

    def make(**limits: object) -> Local:
        made.append(Local(**limits))
        return made[-1]

    yield make  # type: ignore[misc]
    for each in made:
        each.close()


def post(body: bytes = b"{}", *extra: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(extra)
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def test_a_head_is_handed_to_uvicorn_no_further_than_its_limit(local, monkeypatch) -> None:
    """One read of a head three times the limit: uvicorn parses at most the limit of it, and
    the answer is our 431, not uvicorn's 400; the app never runs."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    fed: list[int] = []
    parse = HttpToolsProtocol.data_received
    monkeypatch.setattr(HttpToolsProtocol, "data_received",
                        lambda self, data: (fed.append(len(data)), parse(self, data))[1])
    server = local()
    proto, wire = server.connect()
    proto.data_received(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (3 * HEAD_BYTES))
    server.run()
    assert sum(fed) <= HEAD_BYTES and status_of(bytes(wire.out)) == 431 and wire.eof
    assert server.requests == 0 and server.guard.closed["header_bytes"] == 1
    # a request that fits is parsed whole even when its body makes the read larger than that
    proto, wire = server.connect()
    proto.data_received(post(b"x" * (3 * HEAD_BYTES)))
    server.run()
    assert status_of(bytes(wire.out)) == 200 and wire.out.endswith(b"%d" % (3 * HEAD_BYTES))


def test_too_many_headers_are_431_and_never_reach_the_app(local) -> None:
    """The count is checked in on_header (uvicorn's, wrapped): the request is withheld, the
    rest of the read parsed for nothing, and the 431 sent once uvicorn's data_received returns
    (a callback raising would be uvicorn's 400)."""
    server = local()
    proto, wire = server.connect()
    proto.data_received(post(b"{}", *[b"X-%d: y\r\n" % i for i in range(MAX_HEADERS + 3)]))
    server.run()
    assert status_of(bytes(wire.out)) == 431 and b"--max-headers" in wire.out
    assert bytes(wire.out).count(b"HTTP/1.1") == 1 and server.requests == 0
    assert server.guard.closed["header_count"] == 1


def test_too_many_trailers_are_431_and_the_app_sees_a_disconnect(local) -> None:
    server = local()
    proto, wire = server.connect()
    proto.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")
    server.run()
    assert server.requests == 1 and wire.out == b""  # the app waits for the rest of the body
    proto.data_received(b"0\r\n" + b"".join(b"T-%d: t\r\n" % i for i in range(MAX_HEADERS))
                        + b"\r\n")
    server.run()
    assert status_of(bytes(wire.out)) == 431 and bytes(wire.out).count(b"HTTP/1.1") == 1
    assert server.guard.closed["header_count"] == 1


def test_keep_alive_requests_and_idle_close_go_through_uvicorns_timer(local) -> None:
    """The keep_alive_requests-th request is answered with Connection: close; before it, each
    response leaves the connection idle under uvicorn's keep-alive timer, armed with our limit,
    whose handler (ours) closes it counted as an idle timeout."""
    server = local(keep_alive_requests=3, keep_alive_timeout=0.05)
    proto, wire = server.connect()
    assert proto.timeout_keep_alive == 0.05
    for i in range(2):
        proto.data_received(post())
        server.run()
        assert bytes(wire.out).count(b"HTTP/1.1 200") == i + 1 and b"connection: close" not in wire.out
        assert proto.timeout_keep_alive_task is not None and not wire.closed
    proto.data_received(post())
    server.run()
    assert bytes(wire.out).count(b"HTTP/1.1 200") == 3 and wire.out.count(b"connection: close") == 1
    assert wire.closed

    proto, wire = server.connect()
    proto.data_received(post())
    for _ in range(100):  # the timer fires after 0.05 s; a loaded machine may take longer
        server.run(0.05)
        if wire.closed:
            break
    assert wire.closed and server.guard.closed["idle_timeout"] == 1


def test_pipelined_requests_are_answered_in_order(local) -> None:
    server = local()
    proto, wire = server.connect()
    proto.data_received(post(b"1") + post(b"22") + post(b"333"))
    server.run()
    answers = bytes(wire.out).split(b"HTTP/1.1 200")[1:]
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [b"1", b"2", b"3"]
    assert server.requests == 3 and not wire.closed


def test_a_pipelined_head_over_the_limit_ends_the_connection_after_the_answer_before(local) -> None:
    server = local()
    proto, wire = server.connect()
    proto.data_received(post(b"1") + b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * (MAX_HEADERS + 2))
    server.run()
    assert status_of(bytes(wire.out)) == 200 and bytes(wire.out).count(b"HTTP/1.1") == 1
    assert server.requests == 1 and wire.closed and server.guard.closed["header_count"] == 1


def test_invalid_requests_are_counted_and_logged_once_not_each(local, caplog) -> None:
    """uvicorn answers what httptools cannot parse (400, closed); its warning for each one is
    dropped, and the Guard's, at most one every LOG_EVERY_S, says how many."""
    server = local()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            proto, wire = server.connect()
            proto.data_received(b"G\x00T / HTTP/1.1\r\n\r\n")
            assert status_of(bytes(wire.out)) == 400 and wire.closed
    assert server.guard.closed["invalid_request"] == 5 and server.requests == 0
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")]
    assert len([r for r in caplog.records if "invalid_request" in r.getMessage()]) == 1


def test_an_upgrade_is_served_as_http_and_counted(local, caplog) -> None:
    server = local()
    with caplog.at_level(logging.WARNING):
        proto, wire = server.connect()
        proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                            b"Upgrade: websocket\r\n\r\n")
        server.run()
    assert status_of(bytes(wire.out)) == 200 and server.guard.closed["upgrade_refused"] == 1
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")]
