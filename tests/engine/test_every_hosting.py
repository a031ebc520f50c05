"""Behaviour that must not depend on how the engine is hosted (issue 44, part 5): the same HTTP
requests and the same assertions against the server over each hosting, so a hosting that
diverges fails here.

    thread    AsyncEngine: the engine core on a thread of the server's process
    process   CoreClient: the engine core in a process of its own, supervised
    ray       `loraserve serve --replicas 2`: the ingress's EngineClient over a RayTransport: a Serve
              deployment handle, each replica hosting CoreClient (marked `ray`, as
              tests/test_ray_serve.py is: CI's Ray stage runs it, after the main suite)

One server per hosting for the module (a hosting's tests run together), on the tiny demo base
with three random adapters of tenant acme, a batch of 4 per engine and the same engine timeout
and grammar-compile bound everywhere. `slots` is what runs at once: one engine's batch, or every
replica's (Ray). The stall test goes last: it wedges the engine (every replica's, with Ray).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.client.core_client import Backoff, CoreClient
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.server import build_app
from ray_testing import ready, replica_cores
from serve_process import build_served
from server.live import LiveServer

ENGINE_TIMEOUT_S = 8.0  # no progress this long: the engine is stalled (every hosting)
GRAMMAR_TIMEOUT_S = 0.001  # a grammar's compile bound: the schema below never makes it
MAX_BATCH = 4
MAX_LEN = 2048
LONG_TOKENS = 800  # streams long enough that what a test does beside them happens while they run
WAIT_S = 180  # the most any one wait below may take on a loaded machine (never asserted small)
ADMIN_KEY = "every-hosting-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TENANTS = ("flood", "light")  # a key each, the key being the tenant's name
KEYS_FILE = f"""[keys.admin]
sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"
role = "admin"
""" + "".join(f"""
[tenants.{t}]
weight = 1

[keys.{t}]
sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"
role = "user"
tenants = ["{t}"]
""" for t in TENANTS)
# a schema whose grammar takes far longer than GRAMMAR_TIMEOUT_S to compile
SLOW_SCHEMA = {"type": "object", "additionalProperties": False, "required": [f"f{i}" for i in range(60)],
               "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i + 1},{i + 60}}}$"}
                              for i in range(60)}}


def _cfg(base: Path, catalog: Path) -> EngineConfig:
    return EngineConfig(model_dir=str(base), catalog_dir=str(catalog), device="cpu",
                        dtype="float32", max_model_len=MAX_LEN, max_batch_size=MAX_BATCH,
                        torch_threads=1, grammar_compile_timeout_s=GRAMMAR_TIMEOUT_S)


def _until(check: Callable[[], bool], what: str, within_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- the hostings ----------------------------------------------------------------------------------

class InProcess:
    """The app over `engine`, served by uvicorn on a thread of this process."""

    slots = MAX_BATCH

    def __init__(self, engine, keys: Path):
        self.engine = engine
        self.live = LiveServer(build_app(engine, keys=str(keys)), startup_timeout_s=WAIT_S)
        self.live.__enter__()
        self.url = self.live.url

    def close(self) -> None:
        self.live.__exit__(None, None, None)


class ThreadHosting(InProcess):
    """AsyncEngine; wedged by holding its engine thread inside a step."""

    def __init__(self, base: Path, catalog: Path, keys: Path, work: Path):
        engine = AsyncEngine(build_engine(_cfg(base, catalog)), engine_timeout_s=ENGINE_TIMEOUT_S)
        self.wedged, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
        step = engine.transport.engine.step

        def step_held():
            outs = step()
            if self.wedged.is_set() and engine.transport.engine.last_batch_size and not self.release.is_set():
                self.held.set()
                self.release.wait()
            return outs

        engine.transport.engine.step = step_held
        super().__init__(engine, keys)

    def wedge(self) -> None:
        self.wedged.set()
        assert self.held.wait(WAIT_S), "the engine thread never stepped"

    def unwedge(self) -> None:
        self.release.set()


class ProcessHosting(InProcess):
    """CoreClient; wedged by stopping its engine-core process (SIGSTOP)."""

    def __init__(self, base: Path, catalog: Path, keys: Path, work: Path):
        super().__init__(CoreClient(_cfg(base, catalog), engine_timeout_s=ENGINE_TIMEOUT_S,
                                    heartbeat_s=0.1, backoff=Backoff(0.1, 1.0)), keys)
        self.pid: int | None = None

    def wedge(self) -> None:
        self.pid = self.engine.core_pid
        os.kill(self.pid, signal.SIGSTOP)

    def unwedge(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # killed by the supervisor: gone
            os.kill(self.pid, signal.SIGCONT)


class RayHosting:
    """`loraserve serve --replicas 2` on a local Ray (the fewest it takes: one engine is plain
    `serve`), in a session of its own; wedged by stopping every replica's engine-core process
    (SIGSTOP)."""

    replicas = 2
    slots = replicas * MAX_BATCH

    def __init__(self, base: Path, catalog: Path, keys: Path, work: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.ray_tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")  # short: Ray's socket paths
        self.log = work / "server.log"
        cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--replicas", str(self.replicas),
               "--ray-num-cpus", "2", "--ray-object-store-mb", "128", "--port", str(port),
               "--model", str(base), "--catalog", str(catalog), "--device", "cpu",
               "--max-model-len", str(MAX_LEN), "--max-batch-size", str(MAX_BATCH),
               "--torch-threads", "1", "--shutdown-timeout", "5",
               "--engine-timeout", str(ENGINE_TIMEOUT_S),
               "--grammar-compile-timeout-s", str(GRAMMAR_TIMEOUT_S), "--keys", str(keys)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "RAY_TMPDIR": self.ray_tmp})
        self.url = f"http://127.0.0.1:{port}"
        self.cores: list = []
        try:
            _until(lambda: self._up() and ready(self.url), "the Ray server ready", 300)
        except BaseException:
            self.close()
            raise

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-6000:]
        return True

    def wedge(self) -> None:
        self.cores = replica_cores()
        assert len(self.cores) == self.replicas, self.cores
        for core in self.cores:
            core.send_signal(signal.SIGSTOP)

    def unwedge(self) -> None:
        for core in self.cores:
            with contextlib.suppress(Exception):  # psutil.Error: killed by its replica's supervisor
                core.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


HOSTINGS = {"thread": ThreadHosting, "process": ProcessHosting, "ray": RayHosting}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(base, catalog, keys file): the tiny demo base, acme/a, acme/b, acme/c, the keys."""
    root = tmp_path_factory.mktemp("every-hosting")
    base, catalog = build_served(root)
    keys = root / "keys.toml"
    keys.write_text(KEYS_FILE)
    return base, catalog, keys


@pytest.fixture(scope="module", params=["thread", "process", pytest.param("ray", marks=pytest.mark.ray)])
def hosting(request, served, tmp_path_factory) -> Iterator:
    base, catalog, keys = served
    work = tmp_path_factory.mktemp(request.param)
    shutil.copytree(catalog, work / "catalog")  # each hosting's own (the ingress writes to it)
    host = HOSTINGS[request.param](base, work / "catalog", keys, work)
    try:
        yield host
    finally:
        host.close()


@pytest.fixture(scope="module")
def model(hosting) -> str:
    r = httpx.get(hosting.url + "/v1/models", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


# -- requests --------------------------------------------------------------------------------------

def _body(model: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream, **extra}


def _chat(host, headers: dict, body: dict) -> httpx.Response:
    return httpx.post(host.url + "/v1/chat/completions", json=body, headers=headers, timeout=WAIT_S)


class Stream(threading.Thread):
    """One streamed chat completion, read to its end on a thread. `first`: its first event came
    (or it ended without one); `finish`: the last finish reason; `error`: an in-band error's
    body; `done`: [DONE] came."""

    def __init__(self, host, headers: dict, body: dict):
        super().__init__(daemon=True)
        self.url, self.headers, self.body = host.url, headers, {**body, "stream": True}
        self.first, self.ended = threading.Event(), threading.Event()
        self.status: int | None = None
        self.finish: str | None = None
        self.error: dict | None = None
        self.done = False
        self.text = ""
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body,
                              headers=self.headers, timeout=WAIT_S) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.text = r.read().decode()
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        return
                    event = json.loads(line[len("data: "):])
                    self.first.set()
                    if "error" in event:
                        self.error = event["error"]
                    for choice in event.get("choices", []):
                        self.finish = choice.get("finish_reason") or self.finish
        finally:
            self.first.set()
            self.ended.set()

    def served(self) -> bool:
        """It ran to its length, cleanly."""
        return self.status == 200 and self.done and self.finish == "length" and self.error is None

    def ended_cleanly(self) -> bool:
        """It ran to its length, or ended with one error event, then [DONE]."""
        return self.status == 200 and self.done and (self.finish == "length" or self.error is not None)


def _residency(host, adapter_id: str) -> httpx.Response:
    return httpx.get(f"{host.url}/v1/adapters/{adapter_id}", headers=ADMIN, timeout=WAIT_S)


def _unload(host, adapter_id: str) -> httpx.Response:
    return httpx.post(host.url + "/v1/unload_lora_adapter", json={"lora_name": adapter_id},
                      headers=ADMIN, timeout=WAIT_S)


# -- the behaviour ---------------------------------------------------------------------------------

def test_residency_of_a_loaded_adapter_and_of_an_unknown_one(hosting) -> None:
    """An adapter that just served is on the device (gpu); an id the catalog lacks is a 404."""
    r = _chat(hosting, ADMIN, _body("acme/a", 2))
    assert r.status_code == 200, r.text
    r = _residency(hosting, "acme/a")
    assert r.status_code == 200, r.text
    assert r.json()["residency"] == "gpu", r.json()
    missing = _residency(hosting, "acme/missing")
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"]["code"] == "model_not_found", missing.text


def test_a_grammar_that_does_not_compile_in_its_bound_fails_that_request_only(hosting, model) -> None:
    """A request whose grammar is still compiling at the bound gets a 400 naming the field;
    a request streaming beside it, and one after it, are served."""
    beside = Stream(hosting, ADMIN, _body(model, 64))
    r = _chat(hosting, ADMIN, _body(model, 8, response_format={
        "type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "did not compile within" in err["message"] and err["param"], err
    beside.join(WAIT_S)
    assert beside.served(), (beside.status, beside.finish, beside.error, beside.text)
    after = _chat(hosting, ADMIN, _body(model, 2))
    assert after.status_code == 200, after.text


def test_unloading_an_adapter_while_its_requests_stream(hosting, model) -> None:
    """Unloading acme/b while two of its requests and a base request stream: its requests run
    to their end or end with one error event (never torn), the base request is served, the
    adapter serves again afterwards, and an unload with nothing in flight leaves it on disk."""
    streams = [Stream(hosting, ADMIN, _body(m, LONG_TOKENS)) for m in ("acme/b", "acme/b", model)]
    for s in streams:
        assert s.first.wait(WAIT_S) and s.status == 200, (s.status, s.text)
    r = _unload(hosting, "acme/b")
    assert r.status_code == 200, r.text
    for s in streams:
        s.join(WAIT_S)
        assert s.ended_cleanly(), (s.status, s.done, s.finish, s.error, s.text)
    assert streams[-1].served(), (streams[-1].finish, streams[-1].error)
    again = _chat(hosting, ADMIN, _body("acme/b", 2))
    assert again.status_code == 200, again.text
    assert _unload(hosting, "acme/b").status_code == 200
    r = _residency(hosting, "acme/b")
    assert r.status_code == 200 and r.json()["residency"] == "disk", r.text


def test_a_light_tenant_is_served_before_a_flood_drains(hosting, model) -> None:
    """Tenant flood opens four times what runs at once of long requests; once they fill the
    slots, tenant light sends two short ones: both are served while flood still has requests
    left, though they came after all of flood's (the share is in tokens: flood's are far ahead).
    Four waves, not two: on a fast host a wave of the demo base's long streams ends within a
    second, and two of them drained before a light request on a busy ingress was answered."""
    flood_key = {"Authorization": "Bearer flood"}
    light_key = {"Authorization": "Bearer light"}
    flood = [Stream(hosting, flood_key, _body(model, LONG_TOKENS)) for _ in range(4 * hosting.slots)]
    _until(lambda: sum(s.first.is_set() for s in flood) >= hosting.slots, "flood in every slot")
    answers: list[httpx.Response] = []
    light = [threading.Thread(target=lambda: answers.append(_chat(hosting, light_key, _body(model, 4))))
             for _ in range(2)]
    for t in light:
        t.start()
    for t in light:
        t.join(WAIT_S)
    drained = sum(s.ended.is_set() for s in flood)
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert drained < len(flood), ("light was served after all of flood's requests",
                                  [(s.status, s.finish, s.error) for s in flood])
    for s in flood:
        s.join(WAIT_S)
        assert s.served(), (s.status, s.finish, s.error, s.text)


def test_a_wedged_engine_is_not_ready_and_fails_its_request_then_serves_again(hosting, model) -> None:
    """An engine loop that makes no progress: /ready turns 503, the request streaming on it
    ends with one clean 503 error event once the engine timeout passes (the process hostings
    kill and replace the core; the thread's watch ends what is in flight), and once the engine
    moves again (a new core, or the thread released) the server is ready and serves (a request
    meanwhile gets the 503 a client retries, never another error)."""
    s = Stream(hosting, ADMIN, _body(model, MAX_LEN - 64))
    assert s.first.wait(WAIT_S) and s.status == 200, (s.status, s.text)
    hosting.wedge()
    try:
        _until(lambda: not ready(hosting.url), "/ready 503 while wedged")
        s.join(WAIT_S)
        assert s.done and s.error is not None, (s.status, s.finish, s.error, s.text)
        assert s.error["code"] == "engine_unavailable", s.error
    finally:
        hosting.unwedge()
    _until(lambda: ready(hosting.url), "/ready 200 again")
    _until(lambda: _served_or_unavailable(_chat(hosting, ADMIN, _body(model, 2))), "served again")


def _served_or_unavailable(r: httpx.Response) -> bool:
    """200: served; else it must be the 503 a client retries (an engine not back yet: with Ray,
    the replica a request went to may still be starting its new core when another reports)."""
    assert r.status_code in (200, 503), r.text
    assert r.status_code == 200 or r.json()["error"]["code"] == "engine_unavailable", r.text
    return r.status_code == 200
