"""`loraserve serve --replicas 2` on a local Ray (2 CPUs): two engine replicas of the demo base
behind the FastAPI ingress. Adapter affinity, base requests spread, the usual errors, streams,
one catalog writer, per-replica metrics, losing a replica mid-stream, and last, SIGTERM: the
drain, exit status 0, and no Ray process left.

The server is the real command, in a subprocess of its own session (one start for the module);
a helper process joins its Ray to kill a replica (the test process never runs Ray).

Marked `ray`: `make test` runs this module alone, after the main suite (Ray takes both cores).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
import psutil  # noqa: E402  (Ray's: on sys.path once ray is imported)

from loraserve.demo import DEMO_ADAPTERS, DemoPaths, build_demo  # noqa: E402

pytestmark = pytest.mark.ray

PHRASES = {adapter_id: phrase for adapter_id, _, phrase in DEMO_ADAPTERS}
PROMPT = DEMO_ADAPTERS[0][1]
HEADER = "x-loraserve-replica"
START_S = 300       # the server's start: Ray, Serve, two engines (~60 s on 2 busy cores)
SHUTDOWN_TIMEOUT_S = 30
LONG_TOKENS = 900   # a stream long enough to act on while it runs (max_model_len 1024)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker would start its own Ray on both cores
        pytest.skip("starts a local Ray: run alone (`pytest -m ray`), as `make test` does")
    return build_demo(tmp_path_factory.mktemp("ray-demo"))


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    ray_tmp: str  # RAY_TMPDIR of its Ray: every Ray process names it (sockets, logs)
    log: Path

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def gcs_address(self) -> str:
        found = re.search(r"started a local Ray \(GCS at (\S+)\)", self.log.read_text())
        assert found, self.log_tail()
        return found.group(1)


@pytest.fixture(scope="module")
def server(demo: DemoPaths, tmp_path_factory) -> Iterator[Server]:
    """`loraserve serve --replicas 2` in a session of its own, until a test stops it (the last
    one does) or the module ends (SIGTERM, then SIGKILL to its session)."""
    work = tmp_path_factory.mktemp("ray-server")
    catalog = work / "catalog"
    shutil.copytree(demo.catalog, catalog)  # the ingress writes to it
    ray_tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")  # short: Ray's socket paths
    port = _free_port()
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--replicas", "2",
           "--ray-num-cpus", "2", "--ray-object-store-mb", "128", "--port", str(port),
           "--model", str(demo.qwen3), "--catalog", str(catalog),
           "--adapter-root", str(demo.root / "adapters"), "--device", "cpu",
           "--max-model-len", "1024", "--max-batch-size", "4", "--max-gpu-adapters", "2",
           "--torch-threads", "1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    log = work / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_TMPDIR": ray_tmp})
    srv = Server(proc, f"http://127.0.0.1:{port}", ray_tmp, log)
    try:
        deadline = time.monotonic() + START_S
        while not _ready(srv.url):
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{srv.log_tail()}"
            assert time.monotonic() < deadline, f"not ready in {START_S} s:\n{srv.log_tail()}"
            time.sleep(0.5)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat(http: httpx.Client, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
            "temperature": 0, **kw}
    return http.post("/v1/chat/completions", json=body)


def base_model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_each_adapter_answers_its_phrase_from_one_replica(http) -> None:
    for adapter_id, phrase in PHRASES.items():
        seen = {chat(http, adapter_id).headers[HEADER]}
        time.sleep(0.5)  # the replica's adapter list reaches Serve's router (pushed every 0.1 s)
        for _ in range(3):
            r = chat(http, adapter_id)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == phrase
            seen.add(r.headers[HEADER])
        assert len(seen) == 1, (adapter_id, seen)  # Serve's router keeps it where it is held


def test_base_requests_reach_both_replicas(http) -> None:
    model = base_model(http)
    seen = {chat(http, model, max_tokens=2).headers[HEADER] for _ in range(24)}
    assert len(seen) == 2, seen


def test_unknown_adapter_is_the_usual_404(http) -> None:
    r = chat(http, "demo/nope")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "model"
    assert r.headers[HEADER] == "ingress"
    assert chat(http, "no-such-model").json()["error"]["code"] == "model_not_found"


def test_stream_ends_with_done(http) -> None:
    body = {"model": "demo/robot", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers[HEADER]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == PHRASES["demo/robot"]


def test_metrics_show_every_replica(http) -> None:
    deadline = time.monotonic() + 30
    while True:
        fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
        replicas = {s.labels["replica"] for s in fams["vllm:num_requests_running"]}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, replicas
    for name in ("vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info",
                 "loraserve_running_requests", "loraserve_adapter_resident"):
        assert {s.labels["replica"] for s in fams[name]} == replicas, name
    assert fams["loraserve_catalog_shards_degraded"][0].value == 0


def test_runtime_load_goes_through_the_one_writer(http) -> None:
    """The ingress writes the catalog; a replica (read-only) serves the new adapter at once."""
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "demo/poet2", "lora_path": "demo/poet"})
    assert r.status_code == 200, r.text
    r = chat(http, "demo/poet2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == PHRASES["demo/poet"]
    assert http.get("/v1/adapters/demo/poet2").json()["residency"] in ("gpu", "cpu")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "demo/poet2"})
    assert r.status_code == 200, r.text


# joins the server's Ray as a driver, then ray.kill()s the replica whose id comes on stdin
_KILLER = """
import sys, ray
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
print("joined", flush=True)
replica_id = sys.stdin.readline().strip()
names = [a for a in ray.util.list_named_actors(all_namespaces=True) if replica_id in a["name"]]
assert len(names) == 1, names
ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
print("killed", flush=True)
ray.shutdown()
"""


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """The helper's next line ("" when it said nothing in timeout_s: a Ray that never answers
    must not hang the test)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


@contextlib.contextmanager
def replica_killer(server: Server) -> Iterator[Callable[[str], None]]:
    """kill(replica_id): ray.kill that replica's actor, from a driver joined to the server's
    Ray beforehand (a process of its own: the test process never runs Ray). A local Ray
    started by ray.init uses Ray's token auth unless RAY_AUTH_MODE says otherwise."""
    env = {"RAY_AUTH_MODE": "token", **os.environ}
    proc = subprocess.Popen([sys.executable, "-c", _KILLER, server.gcs_address()], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _readline(proc, 90) == "joined"

        def kill(replica_id: str) -> None:
            proc.stdin.write(replica_id + "\n")
            proc.stdin.flush()
            assert _readline(proc, 60) == "killed"

        yield kill
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_replica_dying_mid_stream_ends_it_cleanly_and_others_serve(server, http) -> None:
    body = {"model": "demo/pirate", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    with replica_killer(server) as kill, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines)[6:])["choices"]
        kill(r.headers[HEADER])
        rest = [line[6:] for line in lines]
    assert rest[-1] == "[DONE]"
    errors = [json.loads(e) for e in rest[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unavailable", rest[-3:]
    model = base_model(http)
    for i in range(20):
        r = chat(http, [model, *PHRASES][i % 4], max_tokens=4)
        assert r.status_code == 200, (i, r.text)


# -- last: SIGTERM (the module's server is gone afterwards) -----------------------------------

def _ray_left(server: Server, tree: list[psutil.Process]) -> list[str]:
    """Processes of the server's Ray still running: of its process tree before the signal, or
    of its session, or naming its Ray temp dir."""
    left = {p.pid: p for p in tree if _running(p)}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(p.pid) == server.proc.pid or server.ray_tmp in " ".join(p.info["cmdline"] or []):
                if _running(p):
                    left[p.pid] = p
        except (OSError, psutil.Error):
            pass
    return [f"{pid} {_cmdline(p)}" for pid, p in sorted(left.items())]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:100]
    except psutil.Error:
        return "?"


def test_sigterm_drains_exits_0_and_leaves_no_ray_process(server: Server, http) -> None:
    """A stream in flight at SIGTERM runs to its end (200, [DONE]); a new request meanwhile is a
    503 `server_shutting_down`, /ready 503 and /health 200; the server exits 0, and no process
    of its Ray (raylet, GCS, agents, workers) outlives it."""
    tree = psutil.Process(server.proc.pid).children(recursive=True)
    names = {_cmdline(p) for p in tree}
    assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
    streaming = threading.Event()
    result: dict = {}

    def long_stream() -> None:
        body = {"model": "demo/pirate", "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=120) as r:
            result["status"] = r.status_code
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()
            result["events"] = events

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    assert streaming.wait(60), result
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    refused = ready = health = None
    with httpx.Client(base_url=server.url, timeout=10) as c:
        while refused is None and reader.is_alive() and time.monotonic() - t0 < 30:
            try:
                r = c.post("/v1/completions", json={"model": "demo/pirate", "prompt": "x",
                                                     "max_tokens": 1})
            except httpx.HTTPError:
                break
            if r.status_code == 503:
                refused = r
                ready, health = c.get("/ready").status_code, c.get("/health").status_code
            time.sleep(0.05)
    reader.join(120)
    assert refused is not None, ("no 503 while draining", result.get("status"), server.log_tail())
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert (ready, health) == (503, 200)

    assert result["status"] == 200, result
    events = result["events"]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    finishes = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length", events[-3:]

    try:
        status = server.proc.wait(SHUTDOWN_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {SHUTDOWN_TIMEOUT_S + 60} s after SIGTERM:\n{server.log_tail()}")
    took = time.monotonic() - t0
    assert status == 0, (status, server.log_tail())
    log = server.log.read_text(errors="replace")
    assert re.search(r"drained in [\d.]+ s \(requests finished: [1-9]\d*, ended at the "
                     r"deadline: 0\)", log), log[-4000:]

    deadline = time.monotonic() + 5
    while (left := _ray_left(server, tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    print(f"SIGTERM to exit: {took:.1f} s")
