"""API key, /metrics, lifespan, and aborting engine requests when a stream's client leaves."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from loraserve.server import build_app
from loraserve.server.app import resolve_api_key

from .fake_engine import FakeEngine
from .live import LiveServer

GOOD = {"model": "fake-base", "prompt": "ab", "max_tokens": 2}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_api_key_guards_v1_only() -> None:
    with LiveServer(build_app(FakeEngine(), api_key="s3cret")) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        missing = http.post("/v1/completions", json=GOOD)
        wrong = http.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer nope"})
        unauth_bad_json = http.post("/v1/completions", content=b"{")
        for r in (missing, wrong, unauth_bad_json, http.get("/v1/models")):
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="s3cret", max_retries=0) as ok:
            assert ok.completions.create(**GOOD).choices[0].text
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="bad", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("explicit") == "explicit"
    monkeypatch.setenv("LORASERVE_API_KEY", "")
    assert resolve_api_key(None) is None


def test_metrics_count_requests_tokens_and_engine_gauges() -> None:
    engine = FakeEngine()
    app = build_app(engine)
    residency = Gauge("loraserve_gpu_adapters", "adapters resident on the GPU", registry=None)
    residency.set(3)
    app.state.ctx.metrics.register(residency)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        assert http.post("/v1/completions", json={**GOOD, "n": 2}).status_code == 200
        assert http.post("/v1/completions", json={**GOOD, "stream": True}).status_code == 200
        assert http.post("/v1/completions", json={**GOOD, "max_tokens": -3}).status_code == 400
        assert http.post("/v1/completions", json={**GOOD, "model": "x"}).status_code == 404
        m = samples(http.get("/metrics").text)
    assert m[("loraserve_requests_total", (("status", "200"),))] == 2
    assert m[("loraserve_requests_total", (("status", "400"),))] == 1
    assert m[("loraserve_requests_total", (("status", "404"),))] == 1
    assert m[("loraserve_e2e_latency_seconds_count", ())] == 2
    assert m[("loraserve_ttft_seconds_count", ())] == 2
    assert m[("loraserve_prompt_tokens_total", ())] == 4
    assert m[("loraserve_generation_tokens_total", ())] == 6
    assert m[("loraserve_waiting_requests", ())] == 2
    assert m[("loraserve_kv_cache_usage", ())] == 0.25
    assert m[("loraserve_running_requests", ())] == 0
    assert m[("loraserve_batch_size", ())] == 0
    assert m[("loraserve_gpu_adapters", ())] == 3


def test_each_app_has_its_own_registry() -> None:
    a, b = build_app(FakeEngine()), build_app(FakeEngine())
    assert a.state.ctx.metrics.registry is not b.state.ctx.metrics.registry


def test_lifespan_starts_and_shuts_down_the_engine() -> None:
    engine = FakeEngine()
    with LiveServer(build_app(engine)):
        assert engine.started and not engine.shut_down
    assert engine.shut_down


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**GOOD, "max_tokens": 10_000, "n": 2}),
    ("/v1/chat/completions", {"model": "fake-base", "max_tokens": 10_000,
                              "messages": [{"role": "user", "content": "hi"}]}),
])
def test_client_disconnect_aborts_engine_requests(path: str, body: dict) -> None:
    engine = FakeEngine(max_model_len=20_000, delay_s=0.01)
    with LiveServer(build_app(engine)) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # leaving the block closes the connection mid-stream
        n = body.get("n", 1)
        assert wait_for(lambda: len(engine.aborted) == n), engine.aborted
        assert engine.running == 0
        assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_client_leaving_a_non_streamed_request_aborts_it() -> None:
    engine = FakeEngine(max_model_len=20_000, delay_s=0.01)
    with LiveServer(build_app(engine)) as live:
        with httpx.Client(base_url=live.url, timeout=0.5) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post("/v1/completions", json={**GOOD, "max_tokens": 10_000, "n": 2})
        assert wait_for(lambda: len(engine.aborted) == 2), engine.aborted
        assert engine.running == 0
        assert httpx.post(f"{live.url}/v1/completions", json=GOOD, timeout=30).status_code == 200
