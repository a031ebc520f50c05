"""Structured output over HTTP (issue 23): response_format json_object / json_schema, guided_json,
guided_regex, guided_choice, guided_grammar, structured_outputs, on both endpoints, streamed and
not, on a random tiny base and two adapters: whatever the random model prefers, a constrained
answer follows its grammar and ends "stop"; free requests batched with constrained ones get
exactly what they get alone; a grammar that does not parse is a 400 naming its field."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .live import LiveServer

MAX_MODEL_LEN = 256
ADAPTERS = ("synth/a0000000", "synth/a0000001")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, hf_dense) -> Iterator[tuple[str, AsyncEngine]]:
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.catalog.store import Catalog

    cat_dir = tmp_path_factory.mktemp("structured") / "catalog"
    Catalog.create(cat_dir, shards=1).close()
    assert materialize(MaterializeConfig(cat_dir, hf_dense, 2, rank=2, workers=1,
                                         progress=False)).ok
    engine = AsyncEngine.from_model_dir(str(hf_dense), catalog_dir=str(cat_dir), device="cpu",
                                        dtype="float32", max_model_len=MAX_MODEL_LEN,
                                        max_batch_size=8, max_gpu_adapters=2, max_lora_rank=16)
    with LiveServer(build_app(engine, max_n=4)) as server:
        yield server.url, engine


@pytest.fixture()
def http(real: tuple[str, AsyncEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real[0], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def base(real: tuple[str, AsyncEngine]) -> str:
    return real[1].model_name


def _valid_schema(text: str) -> bool:
    obj = json.loads(text)
    return isinstance(obj, dict) and type(obj.get("a")) is int


# (request fields, check of the text): each kind, as OpenAI or vLLM spells it
KINDS: dict[str, tuple[dict[str, Any], Any]] = {
    "json_object": ({"response_format": {"type": "json_object"}},
                    lambda t: isinstance(json.loads(t), (dict, list))),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, _valid_schema),
    "guided_json": ({"guided_json": SCHEMA}, _valid_schema),
    "guided_json_text": ({"guided_json": json.dumps(SCHEMA)}, _valid_schema),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    "guided_regex": ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
    "guided_grammar": ({"guided_grammar": 'root ::= "x" [a-c]{1,4} "!"'},
                       lambda t: re.fullmatch("x[a-c]{1,4}!", t)),
    "structured_outputs": ({"structured_outputs": {"choice": ["up", "down"]}},
                           lambda t: t in ("up", "down")),
}


def _answer(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """(text, finish reason) of one choice, streamed or not."""
    if not body.get("stream"):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (choice["text"] if "text" in choice else choice["message"]["content"],
                choice["finish_reason"])
    text, reason = "", None
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line.removeprefix("data: "))["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                reason = c.get("finish_reason") or reason
    return text, reason


def _body(path: str, model: str, fields: dict[str, Any], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": 160, "temperature": 1.0, "seed": 3,
                            **fields, **extra}
    if path == "/v1/completions":
        body["prompt"] = "answer: "
    else:
        body["messages"] = [{"role": "user", "content": "answer"}]
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_follows_its_grammar(http: httpx.Client, base: str, kind: str,
                                       stream: bool) -> None:
    fields, valid = KINDS[kind]
    for path in ("/v1/completions", "/v1/chat/completions"):
        # json_object greedy: seeded sampling in an any-JSON grammar wanders into long strings
        extra = {"temperature": 0} if kind == "json_object" else {}
        text, reason = _answer(http, path, _body(path, base, fields, stream=stream, **extra))
        assert reason == "stop" and valid(text), (path, text, reason)


def test_mixed_batch_constrained_and_free(http: httpx.Client, base: str) -> None:
    """Base and an adapter, constrained and free, at once: each free answer is its solo answer,
    each constrained one follows its grammar."""
    path = "/v1/completions"
    free = {"ignore_eos": True, "max_tokens": 12}
    mix = [(base, {**free, "temperature": 0}, None),
           (ADAPTERS[0], KINDS["json_schema"][0], _valid_schema),
           (ADAPTERS[0], {**free, "seed": 9}, None),
           (base, KINDS["guided_regex"][0], KINDS["guided_regex"][1]),
           (ADAPTERS[1], KINDS["guided_choice"][0], KINDS["guided_choice"][1]),
           (ADAPTERS[1], {**free, "temperature": 0}, None)]
    alone = [_answer(http, path, _body(path, m, f)) for m, f, _ in mix]
    with ThreadPoolExecutor(len(mix)) as pool:
        together = list(pool.map(lambda mf: _answer(http, path, _body(path, mf[0], mf[1])), mix))
    for (m, f, valid), solo, joint in zip(mix, alone, together):
        if valid is None:
            assert joint == solo, (m, f)
        else:
            assert joint[1] == "stop" and valid(joint[0]), (m, joint)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_a_grammar_that_does_not_parse_is_a_400_naming_it(http: httpx.Client, base: str,
                                                          fields: dict, param: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = http.post(path, json=_body(path, base, fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_client_response_format(real: tuple[str, AsyncEngine], base: str) -> None:
    with openai.OpenAI(base_url=f"{real[0]}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        r = client.chat.completions.create(
            model=ADAPTERS[1], messages=[{"role": "user", "content": "json please"}],
            max_tokens=160, temperature=1.0, seed=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
        assert r.choices[0].finish_reason == "stop" and _valid_schema(r.choices[0].message.content)
        r = client.completions.create(model=base, prompt="x", max_tokens=8,
                                      extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=base, messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "a", "schema": {"type": 5}}})
        assert err.value.body["param"] == "response_format"
