"""What the connection bounds (loraserve/server/connections.py) cost on the hot path, and what
they hold back under the attacks of issue 22 (rows 3 and 4). One run, servers side by side:

    python bench/connection_bounds.py [--rounds 5] [--duration 3] [--attack]

  plain    hot_path.py's bare FastAPI endpoint under uvicorn's own httptools protocol (what
           `loraserve serve` ran before)
  guarded  the same app under GuardedHttpTools with `loraserve serve`'s default limits

Hot path: 1-token non-streamed completions with `loraserve loadtest`'s raw client at 16 and 64
connections, rounds interleaved; req/s and the server's CPU per request (/proc/<pid>/stat). The
bare endpoint costs ~0.1 ms per request, so the protocol's share shows here far more than behind
the engine (bench/hot_path.py --baseline, for that).

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
    ap.add_argument("--attack", action="store_true")
    ap.add_argument("--attack-mb", type=int, default=16)
    ap.add_argument("--silent", type=int, default=2000)
    args = ap.parse_args()
    if args.mode == "serve":
        return serve(args.port, args.guarded)
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
    if not args.attack:
        return
    print()
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
