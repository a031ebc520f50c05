"""Bad requests get a clear 4xx with an OpenAI error body, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from .fake_engine import FakeEngine

GOOD = {"model": "fake-base", "prompt": "ab", "max_tokens": 2}
CHAT = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OUT_OF_CONTEXT = "x" * 60  # fake max_model_len is 64

# (name, path, json body, expected status, expected param)
CASES = [
    ("missing model", "/v1/completions", {"prompt": "ab"}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": "fake-base"}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "fake-base"}, 400, "messages"),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("unknown adapter", "/v1/completions", {**GOOD, "model": "acme/ghost"}, 404, "model"),
    ("base mismatch", "/v1/completions", {**GOOD, "model": "acme/mismatch"}, 409, "model"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("chat zero max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("prompt + max_tokens too long", "/v1/completions",
     {**GOOD, "prompt": OUT_OF_CONTEXT, "max_tokens": 5}, 400, "prompt"),
    ("prompt alone too long", "/v1/completions",
     {**GOOD, "prompt": "x" * 65, "max_tokens": 0, "echo": True}, 400, "prompt"),
    ("chat too long", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": OUT_OF_CONTEXT}]}, 400, "messages"),
    ("token id above vocab", "/v1/completions", {**GOOD, "prompt": [1, 100]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {**GOOD, "prompt": [[1], [-1]]}, 400, "prompt"),
    ("n too large", "/v1/completions", {**GOOD, "n": 5}, 400, "n"),
    ("n zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("mixed prompt list", "/v1/completions", {**GOOD, "prompt": ["a", 1]}, 400, "prompt"),
    ("bad role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("template rejects", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("image part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("negative temperature", "/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("logprobs too many", "/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("stop token outside vocab", "/v1/completions", {**GOOD, "stop_token_ids": [1000]}, 400,
     "stop_token_ids"),
    ("too many stop strings", "/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(17)]},
     400, "stop"),
    ("huge stop string", "/v1/completions", {**GOOD, "stop": ["x" * 100_000]}, 400, "stop"),
    ("presence penalty out of range", "/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("bad json schema", "/v1/completions", {**GOOD, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ("bad regex", "/v1/completions", {**GOOD, "guided_regex": "[0-9"}, 400, "guided_regex"),
    ("two structured outputs", "/v1/chat/completions",
     {**CHAT, "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("unknown field", "/v1/completions", {**GOOD, "best_answer": True}, 400, "best_answer"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),  # the field that is missing
    ("streamed bad request", "/v1/completions", {**GOOD, "stream": True, "n": 99}, 400, "n"),
    ("wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
]


def assert_error_body(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["param"] == param
    return error


def assert_still_serving(http: httpx.Client) -> None:
    good = http.post("/v1/completions", json=GOOD)
    assert good.status_code == 200 and len(good.json()["choices"][0]["text"]) == 2


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http: httpx.Client, name: str, path: str, body: object, status: int,
                     param: str | None) -> None:
    assert_error_body(http.post(path, json=body), status, param)
    assert_still_serving(http)


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"model": "fake-base",}'])
def test_malformed_json(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error_body(r, 400, None)
    assert "JSON" in error["message"] or "body" in error["message"]
    assert_still_serving(http)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error_body(http.get("/v1/nothing"), 404, None)
    assert http.get("/v1/completions").status_code == 405
    assert_still_serving(http)


def test_engine_bug_is_a_500_with_a_body(http: httpx.Client, engine: FakeEngine) -> None:
    engine.fail_next = RuntimeError("kaboom")
    error = assert_error_body(http.post("/v1/completions", json=GOOD), 500, None)
    assert "RuntimeError" in error["message"] and "kaboom" not in error["message"]
    assert_still_serving(http)


def test_engine_error_keeps_its_status(http: httpx.Client, engine: FakeEngine) -> None:
    from loraserve.engine.types import EngineError

    engine.fail_next = EngineError("queue full", status=503, code="overloaded")
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    assert_still_serving(http)
