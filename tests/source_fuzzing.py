"""A fake Hub upstream that misbehaves, for the source fuzzer (tests and bench/sources_fuzz.py).

`BadHub(root, behave)` serves the Hub's file routes (`HEAD`/`GET /{repo}/resolve/main/{file}`,
as tests/hub_testing.py does) on 127.0.0.1, a free port, from folders `root/owner/name/`; for
each request `behave(repo, method)` picks one of BEHAVIOURS:

- `good`: the file, with honest headers;
- `hang`: reads the request and never answers;
- `drip`: honest headers, then the body one byte every `drip_s`;
- `lie`: states the file's size, then sends `lie_bytes` (far past any cap);
- `reset`: closes the connection with a TCP reset before answering;
- `garbage`: answers bytes that are no HTTP;
- `short`: states the size, sends half, closes;
- `error`: a 500;
- `corrupt` (never drawn by `seeded`): the file with one byte flipped, its ETag the true one's.

Every connection is served on its own thread; `close()` ends them all (hung ones included).
"""
from __future__ import annotations

import hashlib
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

COMMIT = "0" * 39 + "1"
LFS_SUFFIXES = (".safetensors", ".bin")
BEHAVIOURS = ("good", "hang", "drip", "lie", "reset", "garbage", "short", "error")
LIE_SNDBUF = 64 << 10  # a lying connection's send buffer (see BadHub._lie)


def etag_of(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def seeded(seed: int, bad_share: float = 0.8) -> Callable[[str, str], str]:
    """A behaviour picker: for repos of tenant `beta` always good; for the others a seeded draw
    (`bad_share` of them misbehaving)."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def behave(repo: str, method: str) -> str:
        if repo.startswith("beta/"):
            return "good"
        with lock:
            return rng.choice(BEHAVIOURS[1:]) if rng.random() < bad_share else "good"
    return behave


class BadHub:
    def __init__(self, root: Path, behave: Callable[[str, str], str], *, drip_s: float = 2.0,
                 lie_bytes: int = 64 << 20) -> None:
        self.root, self.behave = root, behave
        self.drip_s, self.lie_bytes = drip_s, lie_bytes
        self.seen: list[tuple[str, str, str]] = []  # (method, path, behaviour)
        self.max_sent = 0  # the most body bytes sent on one connection (a lie's)
        self._closing = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._sock.close()
        for conn in list(self._conns):
            try:
                conn.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                while not self._closing.is_set() and self._one(conn):
                    pass
        except OSError:
            pass

    def _one(self, conn: socket.socket) -> bool:
        """Answer one request on `conn`; whether the connection stays open."""
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            head += chunk
        method, target = head.split(b" ", 2)[:2]
        path = target.decode().split("?", 1)[0]
        parts = path.strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._send(conn, 404, {"X-Error-Code": "RepoNotFound"}, b"")
        repo, name = "/".join(parts[:2]), "/".join(parts[4:])
        file = self.root / repo / name
        behaviour = self.behave(repo, method.decode())
        self.seen.append((method.decode(), path, behaviour))
        if not (self.root / repo).is_dir():
            return self._send(conn, 404, {"X-Error-Code": "RepoNotFound"}, b"")
        if not file.is_file():
            return self._send(conn, 404, {"X-Error-Code": "EntryNotFound"}, b"")
        data = file.read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag_of(name, data)}"',
                   "Content-Length": str(len(data))}
        body = b"" if method == b"HEAD" else data
        if behaviour == "corrupt" and body:
            body = bytes([body[0] ^ 1]) + body[1:]
            behaviour = "good"
        elif behaviour == "corrupt":
            behaviour = "good"
        return getattr(self, f"_{behaviour}")(conn, headers, body)

    def _send(self, conn: socket.socket, status: int, headers: dict[str, str], body: bytes,
              length: int | None = None) -> bool:
        lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
        if "Content-Length" not in headers:
            lines.append(f"Content-Length: {len(body) if length is None else length}")
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return True

    def _good(self, conn, headers, body) -> bool:
        return self._send(conn, 200, headers, body)

    def _hang(self, conn, headers, body) -> bool:
        self._closing.wait()
        return False

    def _drip(self, conn, headers, body) -> bool:
        self._send(conn, 200, headers, b"")
        for i in range(len(body)):
            if self._closing.wait(self.drip_s):
                return False
            conn.sendall(body[i:i + 1])
        return True

    def _lie(self, conn, headers, body) -> bool:
        if not body:  # HEAD: the honest size
            return self._send(conn, 200, headers, b"")
        self._send(conn, 200, {k: v for k, v in headers.items() if k != "Content-Length"}, b"",
                   length=self.lie_bytes)
        # a small send buffer: what counts as sent is what the client took, not what the
        # kernel queued for it (up to tcp_wmem's 4 MiB) before the client hung up
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LIE_SNDBUF)
        sent, block = 0, b"\0" * 65536
        while sent < self.lie_bytes and not self._closing.is_set():
            conn.sendall(block)
            sent += len(block)
            self.max_sent = max(self.max_sent, sent)
        return False

    def _reset(self, conn, headers, body) -> bool:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False  # closed at once: a TCP reset

    def _garbage(self, conn, headers, body) -> bool:
        conn.sendall(bytes(random.Random(len(body)).randrange(256) for _ in range(512)))
        return False

    def _short(self, conn, headers, body) -> bool:
        if not body:
            return self._send(conn, 200, headers, b"")
        self._send(conn, 200, headers, body[:len(body) // 2])
        return False

    def _error(self, conn, headers, body) -> bool:
        """A 500 (with a body only where HTTP allows one: not for HEAD), then the connection closed."""
        self._send(conn, 500, {}, b"upstream error" if body else b"")
        return False


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
