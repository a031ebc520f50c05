"""What the connection bounds (loraserve/server/connections.py) cost on the hot path, and what
they hold back under the attacks of issue 22 (rows 3 and 4). One run, servers side by side:

    python bench/connection_bounds.py [--rounds 5] [--duration 3] [--micro] [--attack]

  plain    hot_path.py's bare FastAPI endpoint under uvicorn's own httptools protocol (what
           `loraserve serve` ran before)
  guarded  the same app under GuardedHttpTools with `loraserve serve`'s default limits

Hot path: 1-token non-streamed completions with `loraserve loadtest`'s raw client at 16 and 64
connections, rounds interleaved; req/s and the server's CPU per request (/proc/<pid>/stat). The
bare endpoint costs ~0.1 ms per request, so the protocol's share shows here far more than behind
the engine (bench/hot_path.py --baseline, for that).

--micro, in this process, no sockets: one connection's protocol object fed the same 1-token
POST again and again, its response completed synchronously (a fake transport), plain and guarded
interleaved in batches of 2,000 (60 each): microseconds per request of uvicorn's protocol
callbacks alone, min and median over batches. The figure that load tests on a shared 2-core
machine are too noisy to show.

--count plain|guarded --requests N: only feed N requests to one protocol (no timing), for an
instruction count that no other load on the machine disturbs:
    for v in plain guarded; do for n in 2000 22000; do PYTHONHASHSEED=0 valgrind --tool=callgrind \
      --callgrind-out-file=/tmp/cg.$v.$n python bench/connection_bounds.py --count $v --requests $n
    done; done   # then (Ir at 22000 - Ir at 2000) / 20000 per variant: "summary:" in each file

--attack, against each server afresh (both with the default limits where they apply):
  heads    10 connections each send an unfinished header of --attack-mb MiB: the server's RSS
           growth, and how much each got to send
  silent   --silent connections that never send a byte: how many are still open after 12 s
           (the header deadline is 10 s), and whether /health answers meanwhile

The machine is 2 cores shared by the generator and the servers: read ratios within a round.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import os
import socket
import statistics
import threading
import time

import httpx

from hot_path import Server, bare_app, load

HERE = Path(__file__).resolve()


def serve(port: int, guarded: bool) -> None:
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from loraserve.server.connections import ConnectionLimits, plan_connections, protocol_class
    limits = ConnectionLimits()
    http = protocol_class(limits, plan_connections(limits)) if guarded else HttpToolsProtocol
    uvicorn.run(bare_app(), host="127.0.0.1", port=port, log_level="error", http=http,
                timeout_keep_alive=30)


# -- in process: the protocol alone -------------------------------------------------------------
MICRO_REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: loadtest\r\n"
                 b"Accept: */*\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n"
                 + (b'{"model":"qwen3","prompt":"hello","max_tokens":1,"x":"' + b"a" * 20)[:60])


class FakeTransport:
    def __init__(self) -> None:
        self.closing = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    abort = close

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, key: str, default=None):
        return ("127.0.0.1", 1234) if key in ("peername", "sockname") else default

    def pause_reading(self) -> None:
        pass

    resume_reading = write_eof = pause_reading

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return True


def micro_runner():
    """(classes {"plain", "guarded"}, run(cls, size) -> microseconds per request)."""

    import uvloop
    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from loraserve.server.connections import ConnectionLimits, plan_connections, protocol_class

    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]}
    body = {"type": "http.response.body", "body": b"{}"}

    class Sync:  # the app's answer, sent at once instead of from a task
        def _start_asgi_task(self, cycle, app) -> None:
            for message in (start, body):
                try:
                    cycle.send(message).send(None)
                except StopIteration:
                    pass

    async def app(scope, receive, send) -> None:
        pass

    config = Config(app, lifespan="off", log_level="error")
    config.load()
    loop = uvloop.new_event_loop()
    limits = ConnectionLimits(keep_alive_requests=10**9)
    classes = {"plain": type("Plain", (Sync, HttpToolsProtocol), {}),
               "guarded": type("Guarded", (Sync, protocol_class(limits, plan_connections(limits))), {})}

    def run(cls, size: int) -> float:
        state = ServerState()
        proto = cls(config=config, server_state=state, app_state={}, _loop=loop)
        proto.connection_made(FakeTransport())
        t0 = time.perf_counter()
        for _ in range(size):
            proto.data_received(MICRO_REQUEST)
        elapsed = time.perf_counter() - t0
        assert state.total_requests == size
        return 1e6 * elapsed / max(size, 1)

    return classes, run


def micro(batches: int = 60, size: int = 2000) -> dict:
    import gc
    classes, run = micro_runner()
    gc.disable()
    try:
        res = {name: [] for name in classes}
        for _ in range(batches):
            for name, cls in classes.items():
                res[name].append(run(cls, size))
    finally:
        gc.enable()
    return {name: {"min": min(v), "median": statistics.median(v)} for name, v in res.items()}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def attack_heads(server: Server, mib: int) -> dict:
    """10 connections, each an unfinished header of `mib` MiB, sent as fast as the server takes it."""
    before = rss_mb(server.proc.pid)
    sent: list[int] = []

    def one() -> None:
        n = 0
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nX-Big: ")
                piece = b"a" * 65536
                while n < mib << 20:
                    sock.sendall(piece)
                    n += len(piece)
                time.sleep(1.0)  # holding it, unfinished
        except OSError:
            pass
        sent.append(n)

    threads = [threading.Thread(target=one) for _ in range(10)]
    start = time.monotonic()
    for t in threads:
        t.start()
    peak = before
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_mb(server.proc.pid))
        time.sleep(0.05)
    return {"rss_growth_mb": peak - before, "sent_mb": [round(n / 2**20, 1) for n in sent],
            "seconds": time.monotonic() - start}


def attack_silent(server: Server, count: int) -> dict:
    """`count` connections that never send a byte; open ones after 12 s; /health meanwhile."""
    socks = []
    for _ in range(count):
        try:
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        except OSError:
            break
    time.sleep(0.5)
    fds_peak = open_fds(server.proc.pid)
    try:
        health = httpx.get(server.url + "/health", timeout=5).status_code
    except httpx.HTTPError as exc:
        health = type(exc).__name__
    time.sleep(11.5)
    still = 0
    for s in socks:
        s.setblocking(False)
        try:
            still += s.recv(1) != b""  # b"": closed by the server
        except BlockingIOError:
            still += 1
        except OSError:
            pass
        s.close()
    return {"opened": len(socks), "server_fds_peak": fds_peak, "health_meanwhile": health,
            "still_open_after_12s": still}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "serve"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--guarded", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--count", choices=["plain", "guarded"])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--attack", action="store_true")
    ap.add_argument("--attack-mb", type=int, default=16)
    ap.add_argument("--silent", type=int, default=2000)
    args = ap.parse_args()
    if args.mode == "serve":
        return serve(args.port, args.guarded)
    if args.count:
        classes, run = micro_runner()
        run(classes[args.count], args.requests)
        return None
    if args.micro:
        m = micro()
        print("protocol alone, us per request (min / median of 60 batches of 2,000):")
        for name, v in m.items():
            print(f"- {name}: {v['min']:.2f} / {v['median']:.2f}")
        print(f"- guarded / plain: {m['guarded']['min'] / m['plain']['min']:.3f} (min), "
              f"{m['guarded']['median'] / m['plain']['median']:.3f} (median)\n", flush=True)
    if args.skip_load:
        return attacks(args) if args.attack else None
    variants = {"plain": [], "guarded": ["--guarded"]}
    servers = {name: Server(name, [sys.executable, str(HERE), "serve", *flags], "/health")
               for name, flags in variants.items()}
    rows = []
    try:
        for s in servers.values():
            load(s, client="raw", concurrency=4, duration=1, stream=False)
        for r in range(args.rounds):
            for name, s in servers.items():
                c16 = load(s, client="raw", concurrency=16, duration=args.duration, stream=False)
                c64 = load(s, client="raw", concurrency=64, duration=args.duration, stream=False)
                row = {"round": r, "target": name, "c16": c16["req_per_s"], "c64": c64["req_per_s"],
                       "cpu_us": 1e3 * c16["server_cpu_ms_per_request_api"],
                       "errors": c16["errors"] + c64["errors"]}
                rows.append(row)
                print(f"  r{r} {name:>7}: c16 {row['c16']:7.0f} req/s  c64 {row['c64']:7.0f} req/s  "
                      f"server CPU {row['cpu_us']:6.1f} us/req  errors {row['errors']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print("\n| target | req/s c16 | req/s c64 | server CPU us/req (c16) |\n|---|---:|---:|---:|")
    for name in variants:
        rs = [x for x in rows if x["target"] == name]
        print(f"| {name} | {statistics.median(x['c16'] for x in rs):,.0f} | "
              f"{statistics.median(x['c64'] for x in rs):,.0f} | "
              f"{statistics.median(x['cpu_us'] for x in rs):.1f} |")
    print("\nguarded / plain, per round (median; the rounds in brackets):")
    for key in ("c16", "c64", "cpu_us"):
        ratios = [g[key] / p[key] for p, g in zip(
            [x for x in rows if x["target"] == "plain"], [x for x in rows if x["target"] == "guarded"])]
        print(f"- {key}: {statistics.median(ratios):.3f} "
              f"({', '.join(f'{x:.3f}' for x in ratios)})")
    if args.attack:
        print()
        attacks(args)


def attacks(args: argparse.Namespace) -> None:
    variants = {"plain": [], "guarded": ["--guarded"]}
    for name, flags in variants.items():
        s = Server(name, [sys.executable, str(HERE), "serve", *flags], "/health")
        try:
            heads = attack_heads(s, args.attack_mb)
            print(f"{name}: 10 unfinished {args.attack_mb} MiB headers: RSS +{heads['rss_growth_mb']:.0f} MB, "
                  f"sent MiB {heads['sent_mb']}, {heads['seconds']:.1f} s", flush=True)
        finally:
            s.stop()
        s = Server(name, [sys.executable, str(HERE), "serve", *flags], "/health")
        try:
            silent = attack_silent(s, args.silent)
            print(f"{name}: {silent['opened']} silent connections: server fds at peak "
                  f"{silent['server_fds_peak']}, /health meanwhile {silent['health_meanwhile']}, "
                  f"still open after 12 s: {silent['still_open_after_12s']}", flush=True)
        finally:
            s.stop()


if __name__ == "__main__":
    main()
