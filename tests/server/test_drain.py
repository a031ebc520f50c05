"""Shutdown drains: the server stops accepting, lets requests in flight finish, and at the
shutdown deadline ends what is left with a clean error (a 503 body; an error event then [DONE] in
a stream) instead of a torn connection. In process (DrainingServer in a thread) and for real
(`run_server` in a subprocess, SIGTERM)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loraserve.engine.types import GenerateRequest, RequestOutput
from loraserve.server import build_app

from .fake_engine import FakeEngine
from .live import LiveServer

GOOD = {"model": "fake-base", "prompt": "ab", "max_tokens": 3}
BOUNDED = 3000  # polls of a condition another thread brings about (each sleeps 10 ms)


@dataclass
class GatedEngine(FakeEngine):
    """A FakeEngine whose requests hold after their first token until `gate` opens; a prompt
    starting with "w" holds before its first token (still waiting to start)."""

    gate: threading.Event = field(default_factory=threading.Event)

    async def _deltas(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        first = True
        async for out in super()._deltas(request):
            if first and request.prompt_token_ids[0] == ord("w") - 32:
                await self._gated()
            yield out
            if first:
                await self._gated()
            first = False

    async def _gated(self) -> None:
        while not self.gate.is_set():  # cancellable, unlike a thread blocked on the event
            await asyncio.sleep(0.01)


def wait_until(condition, what: str) -> None:
    for _ in range(BOUNDED):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def refuses_connections(url: str) -> bool:
    try:
        with httpx.Client(timeout=5) as c:
            c.get(f"{url}/health")
    except httpx.TransportError:
        return True
    return False


def sse_events(response: httpx.Response, first: threading.Event | None = None) -> list[str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
            if first is not None:
                first.set()
    return events


def test_requests_in_flight_finish_after_shutdown_begins() -> None:
    engine = GatedEngine()
    live = LiveServer(build_app(engine, shutdown_timeout=60), drain=True).__enter__()
    url, got_first, result = live.url, threading.Event(), {}

    def stream() -> None:
        with httpx.Client(timeout=60) as c, \
                c.stream("POST", f"{url}/v1/completions", json={**GOOD, "stream": True}) as r:
            result["status"] = r.status_code
            result["events"] = sse_events(r, got_first)

    def plain() -> None:
        with httpx.Client(timeout=60) as c:
            result["plain"] = c.post(f"{url}/v1/completions", json=GOOD)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    try:
        for t in threads:
            t.start()
        assert got_first.wait(60)
        wait_until(lambda: engine.running == 2, "both requests running")
        live.begin_shutdown()
        wait_until(lambda: refuses_connections(url), "new connections refused")
        assert live.thread.is_alive() and "plain" not in result  # still draining
        engine.gate.set()
    finally:
        engine.gate.set()
        for t in threads:
            t.join(60)
        live.thread.join(60)
    assert not live.thread.is_alive() and engine.shut_down
    events = result["events"]
    assert result["status"] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) and \
        chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert result["plain"].status_code == 200
    assert len(result["plain"].json()["choices"][0]["text"]) == 3
    assert engine.aborted == []


def test_requests_left_at_the_deadline_end_cleanly() -> None:
    engine = GatedEngine()  # the gate never opens
    live = LiveServer(build_app(engine, shutdown_timeout=0.2), drain=True).__enter__()
    url, got_first, result = live.url, threading.Event(), {}

    def stream() -> None:
        with httpx.Client(timeout=60) as c, c.stream(
                "POST", f"{url}/v1/chat/completions",
                json={"model": "fake-base", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 5, "stream": True}) as r:
            result["status"] = r.status_code
            result["events"] = sse_events(r, got_first)

    def post(name: str, body: dict) -> None:
        with httpx.Client(timeout=60) as c:
            result[name] = c.post(f"{url}/v1/completions", json=body)

    threads = [threading.Thread(target=stream),
               threading.Thread(target=post, args=("plain", GOOD)),
               threading.Thread(target=post, args=("waiting", {**GOOD, "prompt": "wait"}))]
    try:
        for t in threads:
            t.start()
        assert got_first.wait(60)
        wait_until(lambda: engine.running == 3, "three requests in the engine")
        live.begin_shutdown()
        for t in threads:
            t.join(60)
        live.thread.join(60)
    finally:
        engine.gate.set()
    assert not live.thread.is_alive() and engine.shut_down
    events = result["events"]
    assert result["status"] == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == ("server_shutting_down", "server_error")
    for name in ("plain", "waiting"):
        r = result[name]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
    assert engine.running == 0 and len(engine.aborted) == 3  # every engine request was ended


SERVER_SCRIPT = """
import sys
from server.fake_engine import FakeEngine
from loraserve.server import run_server
from loraserve.server.config import ServerConfig
engine = FakeEngine(delay_s=0.05)
run_server(engine, ServerConfig(shutdown_timeout=float(sys.argv[1])), port=0, log_level="info")
"""


def test_sigterm_drains_a_real_server_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, "0.5"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = None
        log = []
        for line in proc.stderr:  # uvicorn logs where it listens
            log.append(line)
            found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "".join(log)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=60) as c:
            assert c.post(f"{url}/v1/completions", json=GOOD).status_code == 200
            with c.stream("POST", f"{url}/v1/completions",
                          json={**GOOD, "max_tokens": 60, "stream": True}) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if len(events) == 1:
                            proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()


def test_finished_and_abandoned_requests_leave_nothing_watched() -> None:
    engine = FakeEngine(delay_s=0.001)
    app = build_app(engine)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        for _ in range(3):
            assert http.post("/v1/completions", json=GOOD).status_code == 200
            with http.stream("POST", "/v1/completions",
                             json={**GOOD, "max_tokens": 50, "stream": True}) as r:
                next(r.iter_lines())  # then the client goes away mid-stream
            with http.stream("POST", "/v1/chat/completions", json={
                    "model": "fake-base", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3, "stream": True}) as r:
                assert list(r.iter_lines())
        wait_until(lambda: engine.running == 0, "every engine request ended")
        assert app.state.ctx.deadline.watched == 0


def test_a_drain_ends_in_time_with_its_engine_core_stopped(tmp_path: Path) -> None:
    """SIGTERM's drain while the engine core is stopped (SIGSTOP) and a stream waits on it: the
    stream ends with its error event at the shutdown deadline, the server does not wait on a core
    that no longer beats (it kills it, instead of asking it to stop and waiting), and the core is
    reaped."""
    from loraserve.demo import build_demo
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.client.core_client import CoreClient

    demo = build_demo(tmp_path / "demo")
    cfg = EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), device="cpu",
                       max_model_len=128, max_batch_size=4, torch_threads=1)
    client = CoreClient(cfg, engine_timeout_s=60)  # the drain deadline comes first
    live = LiveServer(build_app(client, shutdown_timeout=1.0), drain=True).__enter__()
    url, got_first, result = live.url, threading.Event(), {}

    def stream() -> None:
        with httpx.Client(timeout=60) as c, c.stream(
                "POST", f"{url}/v1/completions",
                json={"model": "demo/poet", "prompt": "hi", "max_tokens": 100, "stream": True,
                      "ignore_eos": True}) as r:
            result["status"] = r.status_code
            result["events"] = sse_events(r, got_first)

    t = threading.Thread(target=stream)
    pid = client.core_pid
    try:
        t.start()
        assert got_first.wait(60)
        os.kill(pid, signal.SIGSTOP)
        began = time.monotonic()
        live.begin_shutdown()
        t.join(60)
        live.thread.join(60)
        took = time.monotonic() - began
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert not live.thread.is_alive() and took < 10, took  # not the 10 s a graceful stop may take
    events = result["events"]
    assert result["status"] == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
