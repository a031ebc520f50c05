"""The engine core in its own process (`CoreClient` + `loraserve.engine.core`).

Outputs equal the in-process engine's; the core killed under load ends each request in flight
with one clean 503 and no torn connection, a new core starts, and new requests succeed.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from loraserve.demo import build_demo
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core_client import CoreClient
from loraserve.engine.types import EngineError, GenerateRequest, SamplingParams
from loraserve.server import build_app
from loraserve.tokenizer import Tokenizer

from server.live import LiveServer

ADAPTERS = ["demo/pirate", None, "demo/poet", "demo/robot", "demo/pirate"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> EngineConfig:
    demo = build_demo(tmp_path_factory.mktemp("core") / "demo")
    return EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), device="cpu",
                        max_model_len=128, max_batch_size=8, torch_threads=1)


def _requests(tag: str, max_tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}{i}", [1 + i, 2, 3, 4], SamplingParams(
        max_tokens=max_tokens, temperature=0.7 if i % 2 else 0.0, seed=i, logprobs=2, ignore_eos=True),
        adapter)
        for i, adapter in enumerate(ADAPTERS)]


async def _collect(engine, req: GenerateRequest):
    tokens, logprobs = [], []
    async for out in engine.generate(req):
        tokens += out.token_ids
        logprobs += [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
    return tokens, logprobs


async def _run_all(engine, reqs):
    try:
        return await asyncio.gather(*(_collect(engine, r) for r in reqs))
    finally:
        await engine.shutdown()


def test_core_process_matches_in_process_engine(cfg) -> None:
    local = asyncio.run(_run_all(AsyncEngine.from_config(cfg), _requests("a", 12)))
    remote = asyncio.run(_run_all(CoreClient(cfg), _requests("a", 12)))
    # the same tokens; logprobs equal up to float noise (batches may group differently in time)
    assert [toks for toks, _ in remote] == [toks for toks, _ in local]
    for (_, lr), (_, ll) in zip(remote, local):
        assert [t for t, _ in lr] == [t for t, _ in ll]
        assert max(abs(a - b) for (_, a), (_, b) in zip(lr, ll)) < 1e-4
    assert all(len(toks) == 12 for toks, _ in remote)


async def _kill_under_load(cfg) -> tuple[list, list, int]:
    client = CoreClient(cfg)
    try:
        await client.start()
        first_pid = client.core_pid
        tasks = [asyncio.ensure_future(_collect(client, r)) for r in _requests("k", 100)]
        while client.snapshot.running < len(tasks):  # all of them are in the engine
            await asyncio.sleep(0.01)
        os.kill(first_pid, signal.SIGKILL)
        during = await asyncio.gather(*tasks, return_exceptions=True)
        while not client.ready or client.core_pid == first_pid:
            await asyncio.sleep(0.05)
        after = await asyncio.gather(*(_collect(client, r) for r in _requests("n", 4)))
        return during, after, client.restarts
    finally:
        await client.shutdown()


def test_core_killed_under_load_fails_in_flight_cleanly_then_serves(cfg) -> None:
    during, after, restarts = asyncio.run(_kill_under_load(cfg))
    assert restarts == 1
    assert all(isinstance(e, EngineError) and e.status == 503 and e.code == "engine_unavailable"
               for e in during), during
    assert all(len(toks) == 4 for toks, _ in after)


def test_http_stream_gets_an_error_event_not_a_torn_connection(cfg) -> None:
    client = CoreClient(cfg)
    app = build_app(client)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/completions", json={"model": "demo/pirate", "prompt": "hi",
                                                  "max_tokens": 2}).status_code == 200
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "demo/poet", "prompt": "hello", "max_tokens": 100, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.kill(client.core_pid, signal.SIGKILL)
        t.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == "engine_unavailable"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # new requests succeed once the new core is up
            r = http.post("/v1/completions", json={"model": "demo/robot", "prompt": "hi", "max_tokens": 2})
            if r.status_code == 200:
                break
            assert r.status_code == 503
            time.sleep(0.2)
        assert r.status_code == 200 and client.restarts == 1
        assert http.get("/ready").status_code == 200
        metrics = http.get("/metrics").text
        assert "loraserve_engine_core_restarts 1.0" in metrics and "loraserve_engine_ready 1.0" in metrics


async def _texts(engine, reqs: list[GenerateRequest]) -> tuple[list, object]:
    """Each request's (text, finish reason, tokens); then, once the engine is idle, its snapshot."""
    async def one(req):
        outs = [out async for out in engine.generate(req)]
        return "".join(o.text for o in outs), outs[-1].finish_reason, [t for o in outs for t in o.token_ids]
    try:
        got = await asyncio.gather(*(one(r) for r in reqs))
        for _ in range(1000):  # the stop string's abort reaches the engine
            if engine.snapshot.running == 0 and engine.snapshot.waiting == 0:
                break
            await asyncio.sleep(0.01)
        return got, engine.snapshot
    finally:
        await engine.shutdown()


def test_core_process_stop_string_and_normal_request_finish_together(cfg) -> None:
    """A stop string, now matched in the API process, ends its request (finish "stop", text cut
    before it) and aborts it in the core; a normal request in the same batches runs to its
    length. Both hostings give the same answers, and the core ends idle with its KV freed."""
    tok = Tokenizer.from_dir(cfg.model_dir)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Who are you?"}]))
    greedy = dict(temperature=0.0, ignore_eos=True)

    def reqs() -> list[GenerateRequest]:
        long = cfg.max_model_len - len(prompt)  # would run to the end of the context without it
        return [GenerateRequest("stop", prompt, SamplingParams(max_tokens=long, stop=["pirate"], **greedy),
                                "demo/pirate"),
                GenerateRequest("free", prompt, SamplingParams(max_tokens=12, **greedy), "demo/robot"),
                GenerateRequest("quiet", prompt, SamplingParams(max_tokens=long, stop=[" be a"], **greedy),
                                "demo/pirate", stream=False)]

    local, _ = asyncio.run(_texts(AsyncEngine.from_config(cfg), reqs()))
    remote, snap = asyncio.run(_texts(CoreClient(cfg), reqs()))
    assert remote == local
    (stop_text, stop_reason, stop_ids), (free_text, free_reason, free_ids), quiet = remote
    assert (stop_text, stop_reason) == ("Arr, I be a ", "stop")
    assert tok.decode(stop_ids).startswith("Arr, I be a pirat")  # up to the token that completed it
    assert (free_text, free_reason, len(free_ids)) == ("Beep boop. I", "length", 12)  # byte tokens
    assert quiet[:2] == ("Arr, I", "stop")
    assert snap.running == 0 and snap.waiting == 0 and snap.kv_usage == 0
