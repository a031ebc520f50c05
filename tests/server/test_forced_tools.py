"""Forced tool calls (issue 43, 3): `tool_choice` "required" always yields a tool call, and a
named function or "required" works on a model whose chat template renders no tools, as vLLM
takes them on any model: the tools described in a system message, the answer constrained to a
JSON array of calls.

On the random demo base (Qwen3's template, which renders tools) and on the same base with a
plain ChatML template (which renders none), over HTTP with the openai client's shapes, streamed
and not, greedy and sampled: every answer that ends on its own ends `tool_calls`, with calls
whose arguments parse (strict `json.loads`) and validate against the function's parameters,
strings with free text included (a raw TAB in them once made the whole answer content).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app
from loraserve.server.chat import chat_prompt
from loraserve.server.protocol import ChatCompletionRequest
from loraserve.server.tool_calls import JSON_CALLS, plan_tools
from loraserve.tokenizer import Tokenizer

from .live import LiveServer

PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NOTE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                         "body": {"type": "string", "maxLength": 12},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                  "maxItems": 2}},
        "required": ["title", "body"], "additionalProperties": False}
PING = {"properties": {"host": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
        "required": ["host"]}  # no "type": an object's, as OpenAI's functions are
TOOLS = [{"type": "function", "function": {"name": "save_note", "description": "Save a note.",
                                           "parameters": NOTE}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters at all
PARAMS = {"save_note": NOTE, "ping": {"type": "object", **PING},
          "now": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "Save a note about the weather."}]


def _server(model_dir: Path) -> LiveServer:
    engine = AsyncEngine.from_model_dir(str(model_dir), device="cpu", dtype="float32",
                                        max_model_len=2048, max_batch_size=16,
                                        served_model_name="base")
    return LiveServer(build_app(engine, max_n=4))


@pytest.fixture(scope="module")
def plain_base(tmp_path_factory: pytest.TempPathFactory, demo_dense: Path) -> Path:
    """The demo base with a chat template that renders no tools."""
    out = tmp_path_factory.mktemp("plain") / "base"
    shutil.copytree(demo_dense, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = PLAIN_CHATML
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def urls(demo_dense: Path, plain_base: Path) -> Iterator[dict[str, str]]:
    with _server(demo_dense) as qwen, _server(plain_base) as plain:
        yield {"qwen": qwen.url, "plain": plain.url}


def _ask(url: str, stream: bool, **body: Any) -> dict[str, Any]:
    """{"content", "tool_calls": [(name, arguments)], "finish_reason"} of one chat choice."""
    body = {"model": "base", "messages": ASK, "tools": TOOLS, "max_tokens": 400, **body}
    with httpx.Client(base_url=url, timeout=300) as http:
        if not stream:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for c in choice["message"].get("tool_calls") or []]
            return {"content": choice["message"]["content"], "tool_calls": calls,
                    "finish_reason": choice["finish_reason"]}
        content, calls, reason = "", {}, None
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    content += choice["delta"].get("content") or ""
                    for d in choice["delta"].get("tool_calls") or []:
                        if "id" in d:
                            calls[d["index"]] = [d["function"]["name"], ""]
                        calls[d["index"]][1] += d["function"].get("arguments") or ""
                    reason = choice["finish_reason"] or reason
        return {"content": content or None,
                "tool_calls": [tuple(calls[i]) for i in sorted(calls)], "finish_reason": reason}


def _check_calls(answer: dict[str, Any], names: set[str]) -> None:
    if answer["finish_reason"] == "length":  # cut by max_tokens: the call so far, no promise
        return
    assert answer["finish_reason"] == "tool_calls" and answer["tool_calls"], answer
    assert answer["content"] is None, answer
    for name, arguments in answer["tool_calls"]:
        assert name in names, answer
        jsonschema.validate(json.loads(arguments), PARAMS[name])  # strict: no raw controls


def _runs(url: str, tool_choice: Any, parallel: bool | None = None,
          streams: tuple[bool, ...] = (False, True)) -> list[dict[str, Any]]:
    """Greedy and sampled (four seeds: the old grammar failed 4 of 18 of these), whole and
    streamed, at once."""
    jobs = [(stream, temperature, seed) for stream in streams
            for temperature, seeds in ((0.0, [0]), (1.0, range(4))) for seed in seeds]
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: _ask(url, j[0], tool_choice=tool_choice, temperature=j[1],
                                            seed=j[2], **extra), jobs))


@pytest.mark.parametrize("model", ["qwen", "plain"])
def test_required_always_yields_a_call(urls: dict[str, str], model: str) -> None:
    answers = _runs(urls[model], "required")
    for answer in answers:
        _check_calls(answer, set(PARAMS))
    assert sum(a["finish_reason"] == "tool_calls" for a in answers) >= len(answers) // 2
    for answer in _runs(urls[model], "required", parallel=False, streams=(False,)):
        _check_calls(answer, set(PARAMS))
        assert len(answer["tool_calls"]) <= 1


@pytest.mark.parametrize("model", ["qwen", "plain"])
def test_a_named_function_is_the_one_call(urls: dict[str, str], model: str) -> None:
    named = {"type": "function", "function": {"name": "save_note"}}
    for answer in _runs(urls[model], named, streams=(True,)):
        _check_calls(answer, {"save_note"})
        assert len(answer["tool_calls"]) <= 1


def test_auto_needs_the_models_own_format_and_none_is_free(urls: dict[str, str]) -> None:
    with httpx.Client(base_url=urls["plain"], timeout=300) as http:
        body = {"model": "base", "messages": ASK, "tools": TOOLS, "max_tokens": 4}
        auto = http.post("/v1/chat/completions", json=body)
        assert auto.status_code == 400 and auto.json()["error"]["param"] == "tools"
        assert '"required" and a named function work' in auto.json()["error"]["message"]
        none = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert none.status_code == 200 and "tool_calls" not in none.json()["choices"][0]["message"]


def test_the_default_tool_prompt(plain_base: Path) -> None:
    """No tool template: the tools go in the system message (the conversation's own first,
    the tools after it), none to the template; the grammar is the JSON array's."""
    tok = Tokenizer.from_dir(plain_base)
    plan = plan_tools(TOOLS, "required", None, tok.chat_template)
    assert plan.family is JSON_CALLS and plan.tools is None and plan.max_calls is None
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    text = chat_prompt(ChatCompletionRequest(model="m", messages=messages), tok,
                       system=plan.system).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert '{"name": "save_note", "description": "Save a note.", "parameters": ' in text
    assert "Call one or more of these functions" in text and text.count("<|im_start|>system") == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}, None,
                       tok.chat_template)
    assert "Call the function ping." in named.system and '"save_note"' not in named.system


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": ["object", "null"]}])
def test_parameters_must_describe_an_object(params: dict) -> None:
    from loraserve.server.errors import APIError

    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(APIError) as err:
        plan_tools(tools, "required", None, PLAIN_CHATML)
    assert err.value.param == "tools.0.function.parameters"
