"""The hot path: 1-token requests on one resident adapter next to a bare endpoint, one run.

    python bench/hot_path.py [--rounds 3] [--duration 5] [--stack asyncio,h11] [--baseline DIR ...]
                             [--profile DIR] [--out FILE] [-- extra `loraserve serve` arguments]

Servers, each in its own process on 127.0.0.1 (free ports), all up for the whole run:
  null       a raw asyncio + httptools responder answering a constant: costs almost nothing, so a
             load generator against it shows its own ceiling
  bare       a FastAPI app under uvicorn (the same uvicorn/loop/parser as loraserve) whose POST
             /v1/completions answers a constant: the HTTP stack alone
  loraserve  `loraserve serve` on the demo base and catalog (engine core in its own process), the
             adapter demo/pirate made resident by a warm-up
  baseline   with --baseline DIR, also `loraserve serve` from DIR (e.g. `git archive HEAD` unpacked)
             to compare server changes side by side (same catalog, same generator); repeat
             --baseline for several trees (targets "baseline:<dir name>", e.g. one per change)

Sections (measurements interleaved round by round, so noise hits every target alike):
  1 generator ceiling: `loraserve loadtest` (streamed, as by default) with --client raw / httpx /
    wrk at 64 connections against null and bare; req/s, and the generator's CPU per request
  2 hot path: non-streamed 1-token completions, bare against loraserve: req/s at 16 connections
    (built-in client) and 64 (wrk), latency of one request at a time (p50, p99), and the servers'
    CPU per request (API process and engine core, from /proc/<pid>/stat)
  3 with --profile DIR: py-spy samples the API server and the engine core during 16-connection
    load; raw stacks land in DIR, and the CPU per request is split into where it goes

The machine is 2 cores shared by the generator and the server (and, here, other people's tests):
read ratios measured in the same round, not absolute numbers.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import time
from collections import Counter, defaultdict

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

ADAPTER = "demo/pirate"
HERE = Path(__file__).resolve()
SSE = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":'
       b'[{"index":0,"text":" a","logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
       b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[],'
       b'"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}\n\ndata: [DONE]\n\n')
JSON = (b'{"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
        b'"text":" a","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":4,'
        b'"completion_tokens":1,"total_tokens":5}}')


# -- the two trivial servers -------------------------------------------------------------------------
def bare_app():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            return Response(SSE, media_type="text/event-stream")
        return Response(JSON, media_type="application/json")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def force_stack(loop: str, http: str) -> None:
    """Make every uvicorn.Config in this process use `loop` and `http` (a server variant)."""
    import uvicorn

    init = uvicorn.Config.__init__

    def patched(self, *a, **kw):
        kw["loop"], kw["http"] = loop, http
        init(self, *a, **kw)
    uvicorn.Config.__init__ = patched


def serve_bare(port: int) -> None:
    import uvicorn
    uvicorn.run(bare_app(), host="127.0.0.1", port=port, log_level="warning")


def serve_null(port: int) -> None:
    import httptools

    class Null(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.body = transport, b""
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_body(self, body):
            self.body += body

        def on_message_complete(self):
            payload, kind = (SSE, b"text/event-stream") if b'"stream":true' in self.body else \
                (JSON, b"application/json")
            self.body = b""
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                                 % (kind, len(payload), payload))

    async def main():
        server = await asyncio.get_running_loop().create_server(Null, "127.0.0.1", port)
        await server.serve_forever()

    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# -- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], health: str | None, env: dict | None = None,
                 cwd: str | None = None):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], env=env, cwd=cwd)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode})")
            try:
                if health is None:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return
                if httpx.get(self.url + health, timeout=1).status_code == 200:
                    return
            except (OSError, httpx.HTTPError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{name} did not come up")

    def pids(self) -> dict[str, int]:
        return server_pids(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def server_pids(pid: int) -> dict[str, int]:
    """{"api": pid, "core": pid of its engine-core child, if any}."""
    out = {"api": pid}
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for kid in kids:
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out["core"] = int(kid)
    return out


def cpu_seconds(pid: int | str) -> float:
    """CPU seconds of a process (`pid`) or of one thread (`"<pid>/task/<tid>"`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loraserve_cmd(extra: list[str]) -> list[str]:
    from _common import base_or_demo
    from loraserve.demo import build_demo
    demo = build_demo(Path(".loraserve/demo"))
    return [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(Path(base_or_demo(None)).resolve()),
            "--catalog", str(demo.catalog.resolve()), "--log-level", "warning", *extra]


# -- measurements ------------------------------------------------------------------------------------
def load(server: Server, *, client: str, concurrency: int, duration: float, stream: bool,
         adapter: str | None = None, max_tokens: int = 1) -> dict:
    from loraserve.loadtest import LoadTestConfig, run_loadtest

    pids = server.pids()
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    rep = run_loadtest(LoadTestConfig(
        url=server.url, adapters=[adapter] if adapter else [], base_model="qwen3" if not adapter else None,
        concurrency=concurrency, duration=duration, client=client, stream=stream, prompt_len=4,
        max_tokens=max_tokens, progress=False, timeout=60))
    for k, p in pids.items():
        rep[f"server_cpu_ms_per_request_{k}"] = 1e3 * (cpu_seconds(p) - cpu0[k]) / max(rep["ok"], 1)
    return rep


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ceiling(servers: dict[str, Server], rounds: int, duration: float, clients: list[str]) -> list[dict]:
    rows = []
    for r in range(rounds):
        for target in ("null", "bare"):
            for client in clients:
                rep = load(servers[target], client=client, concurrency=64, duration=duration, stream=True)
                rows.append({"round": r, "target": target, "client": client, "req_per_s": rep["req_per_s"],
                             "errors": rep["errors"], "gen_cpu_us": rep["generator_cpu_us_per_request"]})
                print(f"  ceiling r{r} {target:>5} {client:>5}: {rep['req_per_s']:8.0f} req/s  "
                      f"generator {rep['generator_cpu_us_per_request'] or 0:6.0f} us/req  errors {rep['errors']}",
                      flush=True)
    return rows


def hot_path(servers: dict[str, Server], targets: list[str], rounds: int, duration: float,
             use_wrk: bool) -> list[dict]:
    rows = []
    for r in range(rounds):
        for target in targets:
            adapter = None if target == "bare" else ADAPTER
            s = servers[target]
            tput = load(s, client="raw", concurrency=16, duration=duration, stream=False, adapter=adapter)
            wrk = load(s, client="wrk", concurrency=64, duration=duration, stream=False,
                       adapter=adapter) if use_wrk else None
            one = load(s, client="raw", concurrency=1, duration=duration, stream=False, adapter=adapter)
            streamed = load(s, client="raw", concurrency=16, duration=duration, stream=True, adapter=adapter,
                            max_tokens=16)
            row = {"round": r, "target": target, "req_per_s_c16": tput["req_per_s"],
                   "req_per_s_wrk_c64": wrk["req_per_s"] if wrk else None,
                   "p50_ms_c1": 1e3 * one["e2e_s"]["p50"], "p99_ms_c1": 1e3 * one["e2e_s"]["p99"],
                   "api_cpu_ms": tput["server_cpu_ms_per_request_api"],
                   "core_cpu_ms": tput.get("server_cpu_ms_per_request_core"),
                   "stream16_req_per_s": streamed["req_per_s"],
                   "stream16_api_cpu_ms": streamed["server_cpu_ms_per_request_api"],
                   "errors": tput["errors"] + one["errors"] + streamed["errors"] + (wrk["errors"] if wrk else 0)}
            rows.append(row)
            print(f"  hot r{r} {target:>9}: c16 {row['req_per_s_c16']:6.0f} req/s, wrk c64 "
                  f"{row['req_per_s_wrk_c64'] or 0:6.0f} req/s, c1 p50 {row['p50_ms_c1']:.2f} ms "
                  f"p99 {row['p99_ms_c1']:.2f} ms, CPU/req api {row['api_cpu_ms']:.2f} ms core "
                  f"{row['core_cpu_ms'] or 0:.2f} ms; streamed x16 c16 {row['stream16_req_per_s']:.0f} req/s, "
                  f"API CPU {row['stream16_api_cpu_ms']:.2f} ms/req; errors {row['errors']}", flush=True)
    return rows


# -- profile -------------------------------------------------------------------------------------------
# (category, substrings of a frame "function (file:line)"), looked for from the leaf up: a sample
# is charged to the first category one of its frames matches
CATEGORIES = [
    ("idle (thread-pool workers waiting)", ("_worker (concurrent/futures/thread.py:8",)),
    ("JSON encode/decode", ("json/", "orjson", "jsonable_encoder", "_prepare_response_content",
                            "serialize_response", "msgspec")),
    ("tokenization", ("tokenizer.py", "tokenizers")),
    ("detokenization (TokenRenderer, decode)", ("logprobs.py", "detokeniz", "decode (")),
    ("request validation (pydantic)", ("pydantic", "protocol.py", "_validate", "request_params_to_args")),
    ("adapter resolve (catalog read, thread hop)", ("catalog/", "resolve", "to_thread", "concurrent/futures")),
    ("engine IPC + msgpack (socket or ZeroMQ, API side)", ("zmq/", "wire.py", "msgpack", "core_client.py")),
    ("metrics (prometheus_client)", ("prometheus_client", "RequestClock", "metrics.py")),
    ("HTTP response write (uvicorn -> socket)", ("RequestResponseCycle.send",)),
    ("HTTP parsing (uvicorn/httptools/h11)", ("uvicorn/protocols/http", "h11/", "httptools")),
    ("engine frontend + streaming glue", ("engine/client/frontend.py", "server/streaming.py", "tenancy.py")),
    ("loraserve handlers (endpoint, completions, app)", ("loraserve/server/",)),
    ("ASGI middleware + routing (starlette, fastapi)", ("starlette/", "fastapi/", "anyio/")),
    ("asyncio/uvloop scheduling", ("asyncio/", "uvloop", "Runner.run")),
]
CORE_CATEGORIES = [
    ("model forward (torch)", ("model/", "torch/", "lora/layers", "kernels/", "model_runner.py")),
    ("sampling", ("sampler.py",)),
    ("scheduler + block manager", ("scheduler.py", "block_manager.py")),
    ("adapter tiers (pool, pager)", ("adapters/",)),
    ("engine IPC + msgpack (socket or ZeroMQ, core side)", ("zmq/", "wire.py", "msgpack", "core.py")),
    ("engine loop + outputs", ("engine_core.py", "llm_engine.py", "output.py", "sequence.py")),
]


def categorize(path: Path, categories) -> tuple[Counter, int]:
    counts, total = Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        for frame in reversed(frames):
            hit = next((name for name, keys in categories if any(k in frame for k in keys)), None)
            if hit is not None:
                counts[hit] += n
                break
        else:
            counts["other: " + frames[-1].split(" (")[0]] += n
    return counts, total


def top_self(path: Path, k: int = 12) -> list[tuple[str, int]]:
    c = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            c[stack.split(";")[-1]] += int(n)
    return c.most_common(k)


def profile(server: Server, out: Path, duration: float) -> dict:
    """py-spy on the API server and the engine core during a 16-connection 1-token load."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    pids = server.pids()
    procs = {k: subprocess.Popen([pyspy, "record", "-p", str(p), "-d", str(int(duration) + 1), "-r", "250",
                                  "--nonblocking", "-f", "raw", "-o", str(out / f"{k}.txt")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for k, p in pids.items()}
    time.sleep(1.0)
    rep = load(server, client="raw", concurrency=16, duration=duration, stream=False, adapter=ADAPTER)
    for p in procs.values():
        p.wait(60)
    result = {"req_per_s": rep["req_per_s"]}
    for k in pids:
        cats = CORE_CATEGORIES + CATEGORIES if k == "core" else CATEGORIES
        counts, total = categorize(out / f"{k}.txt", cats)
        busy = total - counts.get(CATEGORIES[0][0], 0)
        ms = rep[f"server_cpu_ms_per_request_{k}"]
        result[k] = {"cpu_ms_per_request": ms, "samples": total,
                     "categories": [(name, n / busy if busy else 0.0, ms * n / busy if busy else 0.0)
                                    for name, n in counts.most_common() if name != CATEGORIES[0][0]],
                     "top_self": top_self(out / f"{k}.txt")}
    return result


# -- report --------------------------------------------------------------------------------------------
def print_tables(ceil_rows, hot_rows, prof, targets) -> None:
    if ceil_rows:
        print("\n### Generator ceiling (`loraserve loadtest`, streamed, 64 connections)\n")
        print("| target | client | req/s (median) | generator CPU us/request | req/s per generator core |")
        print("|---|---|---:|---:|---:|")
        by = defaultdict(list)
        for r in ceil_rows:
            by[(r["target"], r["client"])].append(r)
        for (target, client), rs in by.items():
            cpu = med([r["gen_cpu_us"] for r in rs])
            print(f"| {target} | {client} | {med([r['req_per_s'] for r in rs]):.0f} | {cpu:.0f} | "
                  f"{1e6 / cpu:.0f} |" if cpu else f"| {target} | {client} | - | - | - |")
    if hot_rows:
        print("\n### Hot path: 1-token completions (non-streamed), one resident adapter\n")
        keys = [("req_per_s_c16", "req/s c16 (raw)"), ("req_per_s_wrk_c64", "req/s c64 (wrk)"),
                ("p50_ms_c1", "p50 ms c1"), ("p99_ms_c1", "p99 ms c1"), ("api_cpu_ms", "API CPU ms/req"),
                ("core_cpu_ms", "core CPU ms/req"), ("stream16_req_per_s", "streamed x16 req/s c16"),
                ("stream16_api_cpu_ms", "streamed x16 API CPU ms/req")]
        print("| target | " + " | ".join(h for _, h in keys) + " |")
        print("|---|" + "---:|" * len(keys))
        meds = {}
        for t in targets:
            rs = [r for r in hot_rows if r["target"] == t]
            meds[t] = {k: med([r[k] for r in rs]) for k, _ in keys}
            print(f"| {t} | " + " | ".join("-" if meds[t][k] is None else f"{meds[t][k]:.2f}"
                                           if "ms" in k else f"{meds[t][k]:.0f}" for k, _ in keys) + " |")
        print("\nPer-round ratios against bare (median over rounds):\n")
        for t in targets:
            if t == "bare":
                continue
            ratios = {}
            for k in ("req_per_s_c16", "req_per_s_wrk_c64", "p50_ms_c1"):
                rr = []
                for r in range(max(x["round"] for x in hot_rows) + 1):
                    a = next((x for x in hot_rows if x["round"] == r and x["target"] == t), None)
                    b = next((x for x in hot_rows if x["round"] == r and x["target"] == "bare"), None)
                    if a and b and a[k] and b[k]:
                        rr.append(a[k] / b[k])
                ratios[k] = med(rr)
            print(f"- {t}: c16 throughput {ratios['req_per_s_c16'] or 0:.2f}x bare, wrk c64 "
                  f"{ratios['req_per_s_wrk_c64'] or 0:.2f}x bare, single-request p50 "
                  f"{ratios['p50_ms_c1'] or 0:.2f}x bare")
        for t in targets:
            if not t.startswith("baseline"):
                continue
            print(f"\nloraserve / {t}, per round (median; the rounds in brackets):\n")
            for k, _ in keys:
                rr = []
                for r in range(max(x["round"] for x in hot_rows) + 1):
                    a = next((x for x in hot_rows if x["round"] == r and x["target"] == "loraserve"), None)
                    b = next((x for x in hot_rows if x["round"] == r and x["target"] == t), None)
                    if a and b and a[k] and b[k]:
                        rr.append(a[k] / b[k])
                if rr:
                    print(f"- {k}: {med(rr):.2f} ({', '.join(f'{x:.2f}' for x in rr)})")
    if prof:
        print(f"\n### Profile under 16-connection load ({prof['req_per_s']:.0f} req/s while sampled)\n")
        for k in ("api", "core"):
            if k not in prof:
                continue
            p = prof[k]
            print(f"{k}: {p['cpu_ms_per_request']:.3f} CPU ms per request ({p['samples']} samples)\n")
            print("| where | share | CPU ms/request |\n|---|---:|---:|")
            for name, share, ms in p["categories"][:14]:
                print(f"| {name} | {100 * share:.1f}% | {ms:.3f} |")
            print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="run",
                    choices=["run", "bare-server", "null-server", "serve-variant"])
    ap.add_argument("--stack", metavar="LOOP,HTTP", help="also serve bare and loraserve with this uvicorn "
                    "loop and HTTP parser (e.g. asyncio,h11: what a fresh install without uvloop and "
                    "httptools gets)")
    ap.add_argument("--port", type=int, default=0, help="(bare-server / null-server)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    ap.add_argument("--skip-ceiling", action="store_true")
    ap.add_argument("--skip-hot", action="store_true")
    ap.add_argument("--clients", default="raw,httpx,wrk", help="generator-ceiling clients")
    ap.add_argument("--profile", metavar="DIR", help="also profile loraserve under load with py-spy")
    ap.add_argument("--baseline", metavar="DIR", action="append", default=[],
                    help="also serve loraserve from this source tree (repeatable)")
    ap.add_argument("--out", metavar="FILE", help="write every measurement as JSON")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1:]  # after --: extra `loraserve serve` arguments
    if args.stack and args.mode != "run":
        force_stack(*args.stack.split(","))
    if args.mode == "bare-server":
        return serve_bare(args.port)
    if args.mode == "serve-variant":  # `loraserve <serve_args> --port P` in this process
        from loraserve.cli import main as cli_main
        return cli_main(args.serve_args)  # (they end with the --port Server gave)
    if args.mode == "null-server":
        return serve_null(args.port)
    from loraserve.loadgen.wrk import find_wrk
    use_wrk = find_wrk() is not None
    clients = [c for c in args.clients.split(",") if c != "wrk" or use_wrk]
    servers: dict[str, Server] = {}
    try:
        servers["null"] = Server("null", [sys.executable, str(HERE), "null-server"], None)
        servers["bare"] = Server("bare", [sys.executable, str(HERE), "bare-server"], "/health")
        cmd = loraserve_cmd(args.serve_args)
        servers["loraserve"] = Server("loraserve", cmd, "/health")
        targets = ["bare", "loraserve"]
        if args.stack:
            tag = args.stack.replace(",", "+")
            servers[f"bare[{tag}]"] = Server(f"bare[{tag}]", [sys.executable, str(HERE), "bare-server",
                                                              "--stack", args.stack], "/health")
            servers[f"loraserve[{tag}]"] = Server(f"loraserve[{tag}]", [
                sys.executable, str(HERE), "serve-variant", "--stack", args.stack, "--", *cmd[3:]], "/health")
            targets += [f"bare[{tag}]", f"loraserve[{tag}]"]
        baselines = []
        for tree in args.baseline:
            base = Path(tree).resolve()
            name = "baseline" if len(args.baseline) == 1 else f"baseline:{base.name}"
            servers[name] = Server(name, cmd, "/health", env={"PYTHONPATH": str(base)}, cwd=str(base))
            targets.append(name)
            baselines.append(name)
        for t in targets[1:]:  # warm-up: the adapter resident, the code paths hot
            load(servers[t], client="raw", concurrency=4, duration=2, stream=False, adapter=ADAPTER)
        load(servers["bare"], client="raw", concurrency=4, duration=1, stream=False)
        ceil_rows = [] if args.skip_ceiling else ceiling(servers, args.rounds, args.duration, clients)
        hot_rows = [] if args.skip_hot else hot_path(servers, targets, args.rounds, args.duration, use_wrk)
        prof = profile(servers["loraserve"], Path(args.profile), max(args.duration, 8)) if args.profile else None
        prof_bases = {name: profile(servers[name], Path(args.profile) / name.replace(":", "-"),
                                    max(args.duration, 8)) for name in baselines} if args.profile else {}
    finally:
        for s in servers.values():
            s.stop()
    print_tables(ceil_rows, hot_rows, prof, targets)
    for name, pr in (("loraserve", prof), *prof_bases.items()):
        if pr is None:
            continue
        if name != "loraserve":
            print(f"\n## {name} (--baseline DIR), profiled the same way")
            print_tables([], [], pr, targets)
        for k in ("api", "core"):
            if k in pr:
                print(f"top self frames ({name}, {k}):")
                for frame, n in pr[k]["top_self"]:
                    print(f"  {n:6d}  {frame[:140]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"ceiling": ceil_rows, "hot": hot_rows, "profile": prof,
                                              "profile_baselines": prof_bases}, indent=1))


if __name__ == "__main__":
    main()
