"""Tool calling and the structured-output proof (issue 23, "Done when"), with the official openai
client against a live server on the random demo Qwen3 base and two adapters:

- `json_schema` and a named `tool_choice`, for the base and both adapters in one concurrent
  batch, streamed and not: every answer parses against its schema (the tool's arguments against
  the function's parameters), and the greedy answers of unconstrained neighbours in that batch
  are bit-equal to the same requests run without any constrained request beside them;
- `required` (one call of any tool, or several with parallel_tool_calls) in the family's format;
- `role: tool` and assistant `tool_calls` messages go through the chat template, which renders
  `tools` exactly as transformers renders them;
- what is not honoured is a 400 naming the field.

The random model never writes a tool call on its own, so `auto` is checked through the parser
and the stream's hold-back in tests/server/test_tools_parsers.py.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app
from loraserve.server.chat import chat_prompt
from loraserve.server.protocol import ChatCompletionRequest
from loraserve.tokenizer import Tokenizer

from .live import LiveServer

MAX_MODEL_LEN = 2048  # a prompt with tools is ~1,000 byte tokens: the demo base (4,096 positions)
ADAPTERS = ("synth/a0000000", "synth/a0000001")
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"],
    "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, demo_dense) -> Iterator[tuple[str, AsyncEngine]]:
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.catalog.store import Catalog

    cat_dir = tmp_path_factory.mktemp("tools") / "catalog"
    Catalog.create(cat_dir, shards=1).close()
    assert materialize(MaterializeConfig(cat_dir, demo_dense, 2, rank=2, workers=1,
                                         progress=False)).ok
    engine = AsyncEngine.from_model_dir(str(demo_dense), catalog_dir=str(cat_dir), device="cpu",
                                        dtype="float32", max_model_len=MAX_MODEL_LEN,
                                        max_batch_size=16, max_gpu_adapters=2, max_lora_rank=16)
    with LiveServer(build_app(engine, max_n=4)) as server:
        yield server.url, engine


@pytest.fixture(scope="module")
def client(real: tuple[str, AsyncEngine]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{real[0]}/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def base(real: tuple[str, AsyncEngine]) -> str:
    return real[1].model_name


# -- one answer, streamed or not, as the openai client returns it ----------------------------------

def _ask(client: openai.OpenAI, stream: bool, **kw: Any) -> dict[str, Any]:
    """{"content", "tool_calls": [(name, arguments)], "finish_reason"} of one choice."""
    if not stream:
        choice = client.chat.completions.create(stream=False, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "tool_calls": calls,
                "finish_reason": choice.finish_reason}
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the call's first delta: id, type and name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return {"content": content or None, "tool_calls": [tuple(calls[i]) for i in sorted(calls)],
            "finish_reason": reason}


def _check_calls(answer: dict[str, Any], names: set[str]) -> None:
    assert answer["finish_reason"] == "tool_calls" and answer["tool_calls"], answer
    for name, arguments in answer["tool_calls"]:
        assert name in names
        jsonschema.validate(json.loads(arguments), PARAMS[name])


def _free(client: openai.OpenAI, model: str) -> dict[str, Any]:
    """An unconstrained greedy neighbour: twelve tokens whatever the model prefers."""
    return _ask(client, False, model=model, messages=ASK, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})


def test_constrained_batch_parses_and_free_neighbours_are_unchanged(client: openai.OpenAI,
                                                                    base: str) -> None:
    """The issue's proof: json_schema and a named tool_choice for the base and two adapters,
    streamed and not, all at once beside free greedy requests on the same three models."""
    models = (base, *ADAPTERS)
    with ThreadPoolExecutor(len(models)) as pool:
        alone = list(pool.map(lambda m: _free(client, m), models))
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                     "strict": True}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    jobs = [(kind, m, stream) for m in models for kind in ("schema", "tool")
            for stream in (False, True)] + [("free", m, False) for m in models]

    def run(job: tuple[str, str, bool]) -> dict[str, Any]:
        kind, model, stream = job
        if kind == "free":
            return _free(client, model)
        fields = {"response_format": schema} if kind == "schema" else \
            {"tools": TOOLS, "tool_choice": named}
        return _ask(client, stream, model=model, messages=ASK, max_tokens=120, temperature=1.0,
                    seed=5, **fields)

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = dict(zip(jobs, pool.map(run, jobs)))
    for (kind, model, stream), answer in answers.items():
        if kind == "schema":
            assert answer["finish_reason"] == "stop", answer
            jsonschema.validate(json.loads(answer["content"]), ANSWER)
        elif kind == "tool":
            _check_calls(answer, {"get_weather"})
            assert len(answer["tool_calls"]) == 1 and answer["content"] is None
    assert [answers[("free", m, False)] for m in models] == alone


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_calls_any_tool_in_the_family_format(client: openai.OpenAI, base: str,
                                                      stream: bool) -> None:
    one = _ask(client, stream, model=ADAPTERS[0], messages=ASK, tools=TOOLS,
               tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=1)
    _check_calls(one, set(PARAMS))
    assert len(one["tool_calls"]) == 1
    some = _ask(client, stream, model=base, messages=ASK, tools=TOOLS, tool_choice="required",
                max_tokens=400, seed=2)
    _check_calls(some, set(PARAMS))


@pytest.mark.parametrize("max_tokens", [3, 12, 80])
def test_a_forced_call_cut_by_max_tokens_is_the_call_so_far_streamed_or_not(
        client: openai.OpenAI, base: str, max_tokens: int) -> None:
    """A named call cut by max_tokens: both forms give the same answer, finish `length`, and
    never the call's markup as content: before the call's name is written, no call; after, the
    call as far as written (its name, the arguments' text so far)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=base, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=max_tokens,
              temperature=0, extra_body={"ignore_eos": True})
    whole, streamed = _ask(client, False, **kw), _ask(client, True, **kw)
    assert whole == streamed
    assert whole["finish_reason"] == "length" and whole["content"] is None
    for name, arguments in whole["tool_calls"]:
        assert name == "get_weather" and arguments[:1] in ("", "{")
    if max_tokens == 3:
        assert whole["tool_calls"] == []
    if max_tokens == 80:
        assert len(whole["tool_calls"]) == 1


def test_auto_and_none_leave_the_random_model_free(client: openai.OpenAI, base: str) -> None:
    """The random model writes no call: `auto` answers its text as content, as `none` does."""
    kw = dict(model=base, messages=ASK, tools=TOOLS, max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    auto = _ask(client, False, tool_choice="auto", **kw)
    assert auto == _ask(client, False, tool_choice="none", **kw) == _ask(client, True, **kw)
    assert auto["tool_calls"] == [] and auto["finish_reason"] == "length" and auto["content"]


def test_a_tool_conversation_renders_as_transformers_renders_it(hf_dense) -> None:
    """tools, an assistant turn with tool_calls and a tool result, through our template
    renderer and through transformers' apply_chat_template: the same prompt."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1, "metric": true}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = ChatCompletionRequest(model="m", messages=messages, tools=TOOLS)
    ours = chat_prompt(req, Tokenizer.from_dir(hf_dense), tools=TOOLS).text
    hf = AutoTokenizer.from_pretrained(hf_dense).apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in messages], tools=TOOLS, tokenize=False,
        add_generation_prompt=True)
    assert ours == hf
    assert '"name": "get_weather"' in ours and "<tool_response>\nsunny\n</tool_response>" in ours
    assert ours.index("# Tools") < ours.index("<|im_start|>user")


def test_a_tool_conversation_is_served(client: openai.OpenAI, base: str, hf_dense) -> None:
    """The same conversation over HTTP: the prompt the engine got is the template's."""
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model=base, messages=messages, tools=TOOLS, max_tokens=2,
                                       tool_choice="none")
    req = ChatCompletionRequest(model=base, messages=messages)
    rendered = chat_prompt(req, Tokenizer.from_dir(hf_dense), tools=TOOLS)
    assert r.usage.prompt_tokens == len(rendered.token_ids) and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function",
     "invalid_request"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "invalid_request"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_request"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_request"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "invalid_request"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools.0.function.parameters", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}], "tool_choice": "required"},
     "tools", "invalid_request"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
])
def test_what_is_not_honoured_is_a_400_naming_it(client: openai.OpenAI, base: str,
                                                 fields: dict[str, Any], param: str,
                                                 code: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=base, messages=ASK, max_tokens=4,
                                       extra_body=fields)
    assert (err.value.body["param"], err.value.body["code"]) == (param, code), err.value.body
