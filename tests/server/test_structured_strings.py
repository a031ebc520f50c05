"""JSON answers valid by construction (issue 43, 1, 2 and 4): the grammar never lets a raw
control character, a raw `"` or `\\`, or a surrogate's bytes into a JSON string (escapes only),
writes properties in the schema's order, and allows no free whitespace between JSON tokens.

Grammar level (xgrammar's matcher, no tokenizer), then over HTTP on the random demo base with
`logit_bias` pushing the model towards what the grammar must refuse: a TAB (+100) in strings,
whitespace (+100) between tokens.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import xgrammar as xgr

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.core.structured import JSON_OBJECT_SCHEMA, json_schema_ebnf, rename_rule
from loraserve.server import build_app
from loraserve.server.serving import structured_spec
from loraserve.server.protocol import CompletionRequest

from .live import LiveServer

TAB, SPACE, NEWLINE = 9, 32, 10  # the demo tokenizer's byte tokens


def _accepts(schema: dict | str, text: str | bytes) -> bool:
    ebnf = json_schema_ebnf(schema if isinstance(schema, str) else json.dumps(schema))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(
        xgr.Grammar.from_ebnf(ebnf))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    data = text if isinstance(text, bytes) else text.encode()
    return matcher.accept_string(data) and matcher.is_terminated()


# (schema, JSON it must accept, texts it must refuse); xgrammar's own conversion accepted each
# refused text but the last of a row, or refused an accepted one (minLength's escapes)
CASES = [
    # (xgrammar's length-bounded strings hold no `"`, `\\`, CR or LF at all: kept so)
    ({"type": "string", "minLength": 1, "maxLength": 5},
     ['"a\\tb"', '"\\u0001"', '"ab"'], ['"a\tb"', '"\x01"', '"abcdef"', '"\\n"']),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, ['{"x\\tb": 1}'], ['{"x\tb": 1}']),
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 2}},
     ['{"k": "\\t"}'], ['{"k": "\t"}']),
    ({"type": "string", "pattern": "^a\\tb$"}, ['"a\\tb"'], ['"a\tb"']),
    ({"type": "string", "pattern": '^a"b$'}, ['"a\\"b"'], ['"a"b"']),
    ({"type": "string", "pattern": "^a\\\\b$"}, ['"a\\\\b"'], ['"a\\b"']),
    ({"type": "string", "pattern": "^[\t ]x[^a]$"}, ['"\\tx\\""', '" xb"'], ['"\tx\t"', '" x""']),
    ({"type": "string", "pattern": "^z.$"}, ['"za"', '"z\\""'], ['"z\\n"', '"z"']),
    ({"type": "string", "pattern": '^[a"]+$'}, ['"a\\"a"'], ['"a"a"']),
    ({"type": "string", "format": "email"}, ['"a@b.co"'], ['"a\t@b.co"']),
    ({"enum": ["a\tb", 'x"y']}, ['"a\\tb"', '"x\\"y"'], ['"a\tb"']),
]


@pytest.mark.parametrize(("schema", "good", "bad"), CASES,
                         ids=[json.dumps(c[0])[:40] for c in CASES])
def test_strings_are_json(schema: dict, good: list[str], bad: list[str]) -> None:
    for text in good:
        assert _accepts(schema, text), text
        json.loads(text)  # strict
    for text in bad:
        assert not _accepts(schema, text), text


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 3},
                                    {"type": "string", "pattern": "^.{1,2}$"},
                                    {"type": "object"}])
def test_no_string_holds_a_surrogates_bytes(schema: dict) -> None:
    """U+D8B9's UTF-8-style bytes: not UTF-8, the text would get U+FFFD x 3 (one character of
    the grammar, three of the answer: past a maxLength)."""
    surrogate = b"\xed\xa2\xb9"
    text = b'{"' + surrogate + b'": 1}' if schema["type"] == "object" else b'"' + surrogate + b'"'
    assert not _accepts(schema, text)
    assert _accepts({"type": "string"}, '"caf\u00e9 \u4e2d"')


def test_json_object_and_schemas_are_compact() -> None:
    """No whitespace between tokens but the fixed `", "` and `": "`: nothing to loop on."""
    assert _accepts(JSON_OBJECT_SCHEMA, '{"a": [1, {"b": null}], "c": "d"}')
    assert _accepts(JSON_OBJECT_SCHEMA, "[]") and not _accepts(JSON_OBJECT_SCHEMA, "1")
    for loose in ('{ "a": 1}', '{"a":  1}', '{"a": 1 }', '{"a":\t1}', '[1,\n2]', '{"a":1}'):
        assert not _accepts(JSON_OBJECT_SCHEMA, loose), loose
        assert not _accepts({"type": "object", "properties": {"a": {}}}, loose), loose


def test_properties_come_in_the_schemas_order() -> None:
    """serving keeps the client's key order (no sort_keys): `reasoning` before `answer` is
    generated first; the other order is another grammar (another cache key)."""
    first = {"type": "object", "properties": {"reasoning": {"type": "string"},
                                              "answer": {"type": "integer"}},
             "required": ["reasoning", "answer"], "additionalProperties": False}
    spec = structured_spec(CompletionRequest(model="m", prompt="x", guided_json=first))
    assert list(json.loads(spec.text)["properties"]) == ["reasoning", "answer"]
    assert _accepts(spec.text, '{"reasoning": "r", "answer": 1}')
    assert not _accepts(spec.text, '{"answer": 1, "reasoning": "r"}')
    swapped = {**first, "properties": dict(reversed(first["properties"].items()))}
    other = structured_spec(CompletionRequest(model="m", prompt="x", guided_json=swapped))
    assert other.key != spec.key
    text = json.dumps(first)  # given as JSON text: its order, too
    assert structured_spec(CompletionRequest(model="m", prompt="x", guided_json=text)).text == text


def test_rename_rule_leaves_literals_alone() -> None:
    ebnf = json_schema_ebnf(json.dumps({"type": "object", "properties": {"root": {"const": "root"}},
                                        "required": ["root"]}))
    renamed = rename_rule(ebnf, "root", "call")
    assert renamed.startswith("call ::= ") or "\ncall ::= " in renamed
    assert '\\"root\\"' in renamed and "\nroot ::= " not in renamed


# -- over HTTP, the model pushed towards what the grammar refuses ---------------------------------

@pytest.fixture(scope="module")
def url(demo_dense) -> Iterator[str]:
    engine = AsyncEngine.from_model_dir(str(demo_dense), device="cpu", dtype="float32",
                                        max_model_len=512, max_batch_size=16,
                                        served_model_name="base")
    with LiveServer(build_app(engine)) as live:
        yield live.url


def _answers(url: str, fields: dict[str, Any], bias: dict[int, float],
             max_tokens: int = 80) -> list[tuple[str, str]]:
    """(text, finish reason) of both endpoints, greedy and sampled."""
    out = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for temperature in (0.0, 1.0):
                body = {"model": "base", "max_tokens": max_tokens, "temperature": temperature,
                        "seed": 1, "logit_bias": {str(k): v for k, v in bias.items()}, **fields}
                if path == "/v1/completions":
                    body["prompt"] = "JSON: "
                else:
                    body["messages"] = [{"role": "user", "content": "JSON"}]
                r = http.post(path, json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                out.append((choice.get("text", (choice.get("message") or {}).get("content")),
                            choice["finish_reason"]))
    return out


def _outside_strings(text: str) -> str:
    """`text` with the JSON strings' contents taken out."""
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                out.append(c)
        else:
            in_string = c == '"'
            out.append(c)
    return "".join(out)


def test_a_tab_loving_model_writes_escapes(url: str) -> None:
    """TAB at +100: the answer is still strict JSON (xgrammar's conversion let a raw TAB into a
    length-bounded string: json.loads' "Invalid control character")."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                               "b": {"type": "string", "minLength": 2}},
              "required": ["a", "b"]}
    fields = {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": schema}}}
    for text, reason in _answers(url, fields, {TAB: 100.0}, max_tokens=120):
        assert "\t" not in text, text
        if reason == "stop":
            value = json.loads(text)
            assert "\t" in value["a"] and len(value["a"]) <= 6, value


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                  "maximum": 99},
                                                      "m": {"type": "array", "maxItems": 2,
                                                            "items": {"type": "boolean"}}},
                     "required": ["n", "m"]}},
], ids=["json_object", "json_schema"])
def test_a_whitespace_loving_model_cannot_loop_on_it(url: str, fields: dict) -> None:
    """Space and newline at +100: between tokens the grammar allows only `", "` and `": "`, so
    the answer never runs on whitespace there (the built-in JSON grammar of json_object allowed
    `[ \\n\\t]*` everywhere: the model looped to max_tokens); the schema without strings ends."""
    for text, reason in _answers(url, fields, {SPACE: 100.0, NEWLINE: 100.0}):
        skeleton = _outside_strings(text)
        assert "\n" not in skeleton and "  " not in skeleton, text
        assert all(skeleton[i - 1] in ",:" for i, c in enumerate(skeleton) if c == " "), text
        if "guided_json" in fields:
            assert reason == "stop" and json.loads(text)["m"] is not None, text


def test_an_answer_reasons_before_it_answers(url: str) -> None:
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 8},
                                               "answer": {"enum": ["yes", "no"]}},
              "required": ["reasoning", "answer"]}
    fields = {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "r", "schema": schema}}}
    for text, reason in _answers(url, fields, {}):
        assert text.startswith('{"reasoning": "'), text
        if reason == "stop":
            assert list(json.loads(text)) == ["reasoning", "answer"]
