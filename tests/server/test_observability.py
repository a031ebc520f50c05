"""X-Request-Id echoed (or made), and one structured log line per API request: id, tenant, model,
adapter@revision, status, tokens, TTFT and total time, as text or as one JSON object."""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from loraserve.keys import digest
from loraserve.server import build_app
from loraserve.server.request_log import (JsonFormatter, RequestIdFilter, RequestRecord,
                                          TextFormatter, begin, end, write)

from .fake_engine import FakeEngine
from .live import LiveServer

ACCESS = "loraserve.server.access"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(f'[keys.acme]\nsha256 = "{digest("acme-key").hex()}"\nrole = "user"\n'
                    'tenants = ["acme"]\n')
    with LiveServer(build_app(FakeEngine(), keys=keys)) as live:
        yield live.url


def _lines(caplog: pytest.LogCaptureFixture, count: int = 0) -> list[dict]:
    """The access lines so far; with `count`, once that many are written (a line goes out as the
    server finishes the response, which the client may have read whole a moment before)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [r.request for r in caplog.records if r.name == ACCESS]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def test_the_clients_request_id_is_echoed_and_logged(http: httpx.Client,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    r = http.post("/v1/completions", headers={"X-Request-Id": "trace-42"},
                  json={"model": "acme/support", "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42"
    [line] = _lines(caplog, 1)
    assert line["request_id"] == "trace-42"
    assert line["response_id"] == r.json()["id"]
    assert line | {"ttft_s": 0, "total_s": 0, "response_id": ""} == {
        "request_id": "trace-42", "method": "POST", "path": "/v1/completions", "status": 200,
        "tenant": "acme", "key_id": None, "model": "acme/support", "adapter": "acme/support", "tier": None,
        "prompt_tokens": 2, "completion_tokens": 3, "ttft_s": 0, "total_s": 0, "response_id": ""}
    assert 0 < line["ttft_s"] <= line["total_s"]


def test_an_id_is_made_when_none_or_a_bad_one_is_sent(http: httpx.Client) -> None:
    made = http.get("/v1/models").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    for bad in ("has space", "x" * 129):
        got = http.get("/v1/models", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert got != bad and re.fullmatch(r"[0-9a-f]{32}", got)
    assert "x-request-id" in http.get("/health").headers  # every route carries one


def test_a_stream_is_logged_once_when_it_ends(http: httpx.Client,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    body = {"model": "fake-base", "messages": [{"role": "user", "content": "Yo"}],
            "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["x-request-id"]
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) > 1
    [line] = _lines(caplog, 1)
    assert (line["status"], line["adapter"], line["tenant"]) == (200, "fake-base", None)
    assert line["completion_tokens"] == 5
    assert line["request_id"] == r.headers["x-request-id"]


def test_refusals_are_logged_with_what_was_known(http: httpx.Client,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    missing = http.post("/v1/completions", json={"model": "acme/none", "prompt": "x"})
    bad = http.post("/tokenize", json={"model": "fake-base"})
    assert (missing.status_code, bad.status_code) == (404, 400)
    first, second = _lines(caplog, 2)
    assert (first["status"], first["model"], first["adapter"]) == (404, "acme/none", None)
    assert first["prompt_tokens"] is None and first["ttft_s"] is None
    assert (second["status"], second["path"], second["model"]) == (400, "/tokenize", "fake-base")
    assert second["adapter"] == "fake-base"
    adapter = http.post("/tokenize", json={"model": "acme/support", "prompt": "x"})
    assert adapter.status_code == 200
    third = _lines(caplog, 3)[2]
    assert (third["tenant"], third["adapter"], third["tier"]) == ("acme", "acme/support", None)


def test_a_401_is_logged_and_carries_the_id(keyed: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    with httpx.Client(base_url=keyed, timeout=30) as c:
        r = c.post("/v1/completions", headers={"X-Request-Id": "no-key"},
                   json={"model": "acme/support", "prompt": "x"})
        ok = c.post("/v1/completions", headers={"Authorization": "Bearer acme-key"},
                    json={"model": "fake-base", "prompt": "x", "max_tokens": 1})
    assert (r.status_code, r.headers["x-request-id"]) == (401, "no-key")
    first, second = _lines(caplog, 2)
    assert (first["request_id"], first["status"], first["tenant"]) == ("no-key", 401, None)
    assert (second["status"], second["tenant"]) == (200, "acme")  # the key's home tenant


def _formatted(formatter: logging.Formatter, logger: str, message: str,
               record: RequestRecord | None = None) -> str:
    """One line of `logger` as `formatter` writes it, logged inside `record`'s request."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(formatter.format(r))  # type: ignore[method-assign]
    handler.addFilter(RequestIdFilter())
    log = logging.getLogger(logger)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    token = begin(record) if record is not None else None
    try:
        if message:
            log.info(message)
        elif record is not None:
            write(record)
    finally:
        if token is not None:
            end(token)
        log.removeHandler(handler)
    return lines[0]


def test_json_lines_carry_the_request_fields_and_id() -> None:
    rec = RequestRecord("abc", "POST", "/v1/completions", 200, "acme", "acme/x", "acme/x@r2",
                        "cpu", 4, 6, 0.0123456789, 0.5)
    line = json.loads(_formatted(JsonFormatter(), ACCESS, "", rec))
    assert line["logger"] == ACCESS and line["level"] == "INFO"
    assert {k: line[k] for k in ("request_id", "tenant", "adapter", "tier", "prompt_tokens",
                                 "completion_tokens", "ttft_s", "total_s", "status")} == {
        "request_id": "abc", "tenant": "acme", "adapter": "acme/x@r2", "tier": "cpu",
        "prompt_tokens": 4, "completion_tokens": 6, "ttft_s": 0.012346, "total_s": 0.5,
        "status": 200}
    other = json.loads(_formatted(JsonFormatter(), "loraserve.test", "hello", rec))
    assert (other["message"], other["request_id"]) == ("hello", "abc")
    outside = json.loads(_formatted(JsonFormatter(), "loraserve.test", "hello"))
    assert "request_id" not in outside


def test_text_lines_name_the_request() -> None:
    rec = RequestRecord("abc", "GET", "/v1/models", 200)
    assert _formatted(TextFormatter(), "loraserve.test", "hello", rec).endswith(
        "loraserve.test: [request abc] hello")
    line = _formatted(TextFormatter(), ACCESS, "", rec)
    assert line.endswith("request id=abc method=GET path=/v1/models status=200")


def test_behind_a_proxy_that_echoes_the_id_it_is_logged_not_echoed(
        caplog: pytest.LogCaptureFixture) -> None:
    """Ray Serve's proxy sets X-Request-Id on the request and echoes it itself: the app logs that
    id and adds no second header."""
    import asyncio

    from loraserve.server.metrics import ServerMetrics
    from loraserve.server.middleware import RequestMiddleware

    async def constant(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    caplog.set_level(logging.INFO, logger=ACCESS)
    scope = {"type": "http", "method": "GET", "path": "/v1/models",
             "headers": [(b"x-request-id", b"serve-7")]}
    for echo in (False, True):
        asyncio.run(RequestMiddleware(constant, ServerMetrics(), echo_id=echo)(
            dict(scope), receive, send))
    quiet, echoed = (m["headers"] for m in sent if m["type"] == "http.response.start")
    assert quiet == [] and echoed == [(b"x-request-id", b"serve-7")]
    assert [line["request_id"] for line in _lines(caplog, 2)] == ["serve-7", "serve-7"]


def test_the_ray_ingress_logs_the_proxys_id_without_echoing_it(demo_dense) -> None:
    """`serve --replicas`: the ingress app adds no X-Request-Id of its own (Serve's proxy does)."""
    from starlette.testclient import TestClient

    from loraserve.engine.config import EngineConfig
    from loraserve.ray_serve.config import ScaleOutConfig
    from loraserve.engine.client.frontend import EngineClient
    from loraserve.ray_serve.frontend import RayTransport
    from loraserve.ray_serve.ingress import ingress_app
    from loraserve.server.config import ServerConfig

    front = EngineClient(RayTransport(EngineConfig(model_dir=str(demo_dense)), object(),
                                      ScaleOutConfig(replicas=2)))
    r = TestClient(ingress_app(front, ServerConfig())).get("/health",
                                                           headers={"X-Request-Id": "serve-1"})
    assert r.status_code == 200 and "x-request-id" not in r.headers
    plain = TestClient(build_app(FakeEngine())).get("/health", headers={"X-Request-Id": "p-1"})
    assert plain.headers["x-request-id"] == "p-1"
