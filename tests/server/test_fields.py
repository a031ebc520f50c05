"""Issue 23, first part: every field a client sends is honoured or refused, never ignored.

1. Every field of the official openai client's completions and chat request schemas (read from
   the installed `openai` package, so a new field there fails `test_every_openai_field_is_
   decided` until it is decided), plus the vLLM extensions, sent one at a time with a valid
   value over the fake engine: either honoured (the engine request carries it, or the answer
   shows it) or a 400 naming it. Unknown fields (hypothesis: any name, any JSON value), on both
   endpoints, their /oai/api/v1 twins and the Tinker sampling body, are always a 400 naming them.
2. Over the real engine on the tiny `hf_dense` base (random weights: every logit is within a
   fraction of a unit of the others, so a penalty of 1 or 2 decides a greedy pick, and each case
   below is crafted with logit_bias on top), the sampling extensions have their effect, per
   sequence, also in a batch mixing the base and two adapters, and through the openai client's
   `extra_body`.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import completion_create_params as completion_schema
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_schema

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.core.sampler import sample
from loraserve.engine.types import SamplingParams
from loraserve.server import build_app
from loraserve.server.errors import clip
from loraserve.server.protocol import ChatCompletionRequest, CompletionRequest

from .fake_engine import FakeEngine
from .live import LiveServer

GOOD = {"model": "fake-base", "prompt": "ab", "max_tokens": 2}
CHAT = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PATHS = {"completions": ("/v1/completions", GOOD), "chat": ("/v1/chat/completions", CHAT)}

Check = Callable[[SamplingParams, httpx.Response, FakeEngine], bool]


def params_has(**expected: Any) -> Check:
    return lambda p, r, e: all(getattr(p, k) == v for k, v in expected.items())


def grammar(kind: str) -> Check:
    return lambda p, r, e: p.structured is not None and p.structured.kind == kind


def logged(p: SamplingParams, r: httpx.Response, e: FakeEngine) -> bool:
    return True  # accepted; the test proper checks the log line


REFUSED = "refused"
# (endpoint, field, value, what is expected: a Check (honoured) or REFUSED; extra body fields)
CASES: list[tuple[str, str, Any, Check | str, dict]] = [
    # -- OpenAI completions ----------------------------------------------------------------------
    ("completions", "best_of", 1, params_has(), {}),
    ("completions", "best_of", 3, REFUSED, {}),
    ("completions", "echo", True, lambda p, r, e: r.json()["choices"][0]["text"].startswith("ab"),
     {}),
    ("completions", "frequency_penalty", 0.5, params_has(frequency_penalty=0.5), {}),
    ("completions", "logit_bias", {"33": 5}, params_has(logit_bias={33: 5.0}), {}),
    ("completions", "logprobs", 2, params_has(logprobs=2), {}),
    ("completions", "max_tokens", 3, params_has(max_tokens=3), {}),
    ("completions", "n", 2, lambda p, r, e: len(r.json()["choices"]) == 2, {}),
    ("completions", "presence_penalty", -0.5, params_has(presence_penalty=-0.5), {}),
    ("completions", "seed", 7, params_has(seed=7), {}),
    ("completions", "stop", ["Z"], params_has(stop=["Z"]), {}),
    ("completions", "stream", True,
     lambda p, r, e: r.headers["content-type"].startswith("text/event-stream"), {}),
    ("completions", "stream_options", {"include_usage": True}, REFUSED, {}),  # without stream
    ("completions", "stream_options", {"include_usage": True},
     lambda p, r, e: '"usage": {"prompt_tokens"' in r.text or '"usage":{"prompt_tokens"' in r.text,
     {"stream": True}),
    ("completions", "stream_options", {"include_obfuscation": False},
     lambda p, r, e: r.status_code == 200, {"stream": True}),
    ("completions", "suffix", "tail", REFUSED, {}),
    ("completions", "temperature", 0.5, params_has(temperature=0.5), {}),
    ("completions", "top_p", 0.5, params_has(top_p=0.5), {}),
    ("completions", "user", "user-42", logged, {}),
    # -- OpenAI chat -------------------------------------------------------------------------------
    ("chat", "audio", {"voice": "alloy", "format": "wav"}, REFUSED, {}),
    ("chat", "frequency_penalty", -1.0, params_has(frequency_penalty=-1.0), {}),
    ("chat", "function_call", "none", params_has(), {}),
    ("chat", "function_call", "auto", REFUSED, {}),
    ("chat", "functions", [{"name": "f", "parameters": {}}], REFUSED, {}),
    ("chat", "logit_bias", {"40": -100}, params_has(logit_bias={40: -100.0}), {}),
    ("chat", "logprobs", True, params_has(logprobs=0), {}),
    ("chat", "max_completion_tokens", 3, params_has(max_tokens=3), {"max_tokens": None}),
    ("chat", "max_tokens", 4, params_has(max_tokens=4), {}),
    ("chat", "metadata", {"team": "search"}, logged, {}),
    ("chat", "modalities", ["text"], params_has(), {}),
    ("chat", "modalities", ["text", "audio"], REFUSED, {}),
    ("chat", "moderation", {"mode": "block"}, REFUSED, {}),
    ("chat", "n", 3, lambda p, r, e: len(r.json()["choices"]) == 3, {}),
    ("chat", "parallel_tool_calls", False, params_has(), {}),  # no tools: nothing to call
    ("chat", "prediction", {"type": "content", "content": "x"}, REFUSED, {}),
    ("chat", "presence_penalty", 2.0, params_has(presence_penalty=2.0), {}),
    ("chat", "prompt_cache_key", "conv-7", logged, {}),
    ("chat", "prompt_cache_options", {"mode": "explicit"}, REFUSED, {}),
    ("chat", "prompt_cache_retention", "24h", REFUSED, {}),
    ("chat", "reasoning_effort", "low", REFUSED, {}),
    ("chat", "response_format", {"type": "text"}, params_has(), {}),
    ("chat", "response_format", {"type": "json_object"}, grammar("json_object"), {}),
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
     grammar("json_schema"), {}),
    ("chat", "response_format", {"type": "xml"}, REFUSED, {}),
    ("chat", "safety_identifier", "hashed-user", logged, {}),
    ("chat", "seed", -3, params_has(seed=-3), {}),
    ("chat", "service_tier", "auto", params_has(), {}),
    ("chat", "service_tier", "flex", REFUSED, {}),
    ("chat", "stop", "Q", params_has(stop=["Q"]), {}),
    ("chat", "store", False, params_has(), {}),
    ("chat", "store", True, REFUSED, {}),
    ("chat", "stream", True,
     lambda p, r, e: r.headers["content-type"].startswith("text/event-stream"), {}),
    ("chat", "stream_options", {"include_usage": True}, REFUSED, {}),  # without stream
    ("chat", "stream_options", {"include_obfuscation": True}, REFUSED, {"stream": True}),
    ("chat", "temperature", 0.0, params_has(temperature=0.0), {}),
    ("chat", "tool_choice", "none", params_has(), {}),
    ("chat", "tool_choice", "auto", params_has(), {}),
    ("chat", "tools", [], params_has(), {}),
    # the fake's chat template renders no tools (test_tools.py: a template that does): "auto"
    # needs the model's own format (a forced call on it: test_vllm_habits.py)
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}], REFUSED, {}),
    ("chat", "chat_template_kwargs", {"enable_thinking": False},
     lambda p, r, e: r.json()["usage"]["prompt_tokens"] == len("enable_thinking=False\n"
                                                              "user: hi\nassistant:"), {}),
    ("chat", "top_logprobs", 2, params_has(logprobs=2), {"logprobs": True}),
    ("chat", "top_p", 0.9, params_has(top_p=0.9), {}),
    ("chat", "user", "user-43", logged, {}),
    ("chat", "verbosity", "low", REFUSED, {}),
    ("chat", "web_search_options", {}, REFUSED, {}),
    # -- vLLM extensions, both endpoints ----------------------------------------------------------
    *[(ep, field, value, check, {}) for ep in PATHS for field, value, check in [
        ("top_k", 5, params_has(top_k=5)),
        ("min_p", 0.25, params_has(min_p=0.25)),
        ("repetition_penalty", 1.3, params_has(repetition_penalty=1.3)),
        ("min_tokens", 2, params_has(min_tokens=2)),
        ("stop_token_ids", [33, 34], params_has(stop_token_ids=[33, 34])),
        ("ignore_eos", True, params_has(ignore_eos=True)),
        ("return_tokens_as_token_ids", True, params_has()),
        ("skip_special_tokens", False, params_has(skip_special_tokens=False)),
        ("include_stop_str_in_output", True, params_has(include_stop_str_in_output=True)),
        ("prompt_logprobs", 1, params_has(prompt_logprobs=1)),
        ("guided_json", {"type": "object"}, grammar("json_schema")),
        ("guided_regex", "[a-z]+", grammar("regex")),
        ("guided_choice", ["yes", "no"], grammar("choice")),
        ("guided_grammar", "root ::= \"a\"", grammar("grammar")),
        ("guided_decoding_backend", "xgrammar", params_has()),
        ("guided_decoding_backend", "outlines", REFUSED),
        ("guided_whitespace_pattern", " ", REFUSED),
        ("structured_outputs", {"json": {"type": "object"}}, grammar("json_schema")),
        ("response_format", {"type": "json_object"}, grammar("json_object")),
    ]],
    ("chat", "add_generation_prompt", False, params_has(), {}),
]
IDENTIFIERS = {"user", "metadata", "safety_identifier", "prompt_cache_key"}


def _schema_fields(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def test_every_openai_field_is_decided() -> None:
    """Each field of the installed openai client's request schemas has a case above (and each
    case's field is one the server declares: no case tests an unknown field by accident)."""
    covered = {ep: {c[1] for c in CASES if c[0] == ep} | set(PATHS[ep][1]) for ep in PATHS}
    assert _schema_fields(completion_schema.CompletionCreateParamsNonStreaming) <= \
        covered["completions"] | {"stream"}
    assert _schema_fields(chat_schema.CompletionCreateParamsNonStreaming) <= covered["chat"]
    stream_options = {k for c in CASES if c[1] == "stream_options" for k in c[2]}
    assert _schema_fields(ChatCompletionStreamOptionsParam) <= stream_options
    assert covered["completions"] <= set(CompletionRequest.model_fields)
    assert covered["chat"] <= set(ChatCompletionRequest.model_fields)


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _error(r: httpx.Response, param: str, code: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code,
                                                              "invalid_request_error"), error
    return error


@pytest.mark.parametrize("endpoint,field,value,expect,extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-{json.dumps(c[2])[:24]}" for c in CASES])
def test_each_field_is_honoured_or_refused(http: httpx.Client, engine: FakeEngine,
                                           caplog: pytest.LogCaptureFixture, endpoint: str,
                                           field: str, value: Any, expect: Check | str,
                                           extra: dict) -> None:
    path, base = PATHS[endpoint]
    body = {k: v for k, v in {**base, **extra, field: value}.items() if v is not None}
    before = len(engine.requests)
    caplog.set_level(logging.INFO, logger="loraserve.server.requests")
    r = _post(http, path, body)
    if expect == REFUSED:
        error = _error(r, f"stream_options.{next(iter(value))}"
                       if field == "stream_options" and body.get("stream") else field,
                       "unsupported_parameter")
        assert "not supported" in error["message"] or "only allowed" in error["message"]
        assert len(engine.requests) == before  # nothing reached the engine
        return
    assert r.status_code == 200, r.text
    params = engine.requests[-1].params
    assert len(engine.requests) > before and expect(params, r, engine)
    if field in IDENTIFIERS:  # accepted and logged, with the request's model
        lines = [rec.getMessage() for rec in caplog.records
                 if rec.name == "loraserve.server.requests"]
        assert any(json.dumps(value, ensure_ascii=False)[:40].strip('"') in line
                   for line in lines), lines


@pytest.mark.parametrize("path", ["/v1/completions", "/oai/api/v1/completions"])
def test_null_means_not_given(http: httpx.Client, engine: FakeEngine, path: str) -> None:
    """The openai client sends null for an explicit None: every declared field takes its
    default (OpenAI's own schema has them nullable)."""
    nulls = {name: None for name in CompletionRequest.model_fields
             if name not in ("model", "prompt")}
    r = _post(http, path, {**GOOD, **nulls})
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert (p.max_tokens, p.temperature, p.min_p, p.repetition_penalty, p.logit_bias,
            p.min_tokens) == (16, 1.0, 0.0, 1.0, {}, 0)


BAD_VALUES = [
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", {"100": 1}, "logit_bias"),
    ("logit_bias", {"-1": 1}, "logit_bias"), ("logit_bias", {"5": 100.5}, "logit_bias"),
    ("logit_bias", {"5": 1, "005": 2}, "logit_bias"),
    ("logit_bias", {str(i): 1 for i in range(2000)}, "logit_bias"),
    ("min_tokens", 3, "min_tokens"),  # more than max_tokens (2)
    ("min_tokens", -1, "min_tokens"), ("min_p", 1.5, "min_p"), ("min_p", -0.1, "min_p"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("repetition_penalty", -1, "repetition_penalty"),
    ("presence_penalty", 2.01, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "metadata"),
]


@pytest.mark.parametrize("field,value,param", BAD_VALUES,
                         ids=[f"{f}-{json.dumps(v)[:20]}" for f, v, _ in BAD_VALUES])
def test_out_of_range_values_are_400_naming_the_field(http: httpx.Client, field: str, value: Any,
                                                      param: str) -> None:
    path, base = PATHS["chat" if field == "metadata" else "completions"]
    r = _post(http, path, {**base, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- unknown fields ------------------------------------------------------------------------------

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                     st.floats(allow_nan=False, allow_infinity=False) | _text,
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(_text, inner, max_size=3), max_leaves=6)
_name = st.text(st.characters(exclude_categories=("Cs",)), max_size=300)
_DECLARED = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
_ROUTES = [("/v1/completions", GOOD), ("/v1/chat/completions", CHAT),
           ("/oai/api/v1/completions", GOOD), ("/oai/api/v1/chat/completions", CHAT)]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=_name.filter(lambda n: n not in _DECLARED), value=_json,
       route=st.sampled_from(_ROUTES), stream=st.booleans())
def test_an_unknown_field_is_always_400_naming_it(http: httpx.Client, name: str, value: Any,
                                                  route: tuple[str, dict], stream: bool) -> None:
    path, base = route
    r = _post(http, path, {**base, "stream": stream, name: value})
    error = _error(r, clip(name), "unknown_parameter")
    assert "Unrecognized request argument" in error["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions",
     {**GOOD, "stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}},
     "stream_options.chunk_size"),
    ("/v1/completions", {**GOOD, "use_beam_search": True, "temperature": "hot"},
     "use_beam_search"),  # what should not be there at all is named first
    ("/v1/completions", {**GOOD, "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "prompt": "hi"}, "prompt"),
    ("/v1/completions", {**GOOD, "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs"),
])
def test_unknown_nested_and_cross_endpoint_fields(http: httpx.Client, path: str, body: dict,
                                                  param: str) -> None:
    _error(_post(http, path, body), param, "unknown_parameter")


TINKER_SAMPLE = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [33, 34]}]},
                 "sampling_params": {"max_tokens": 2}, "base_model": "fake-base",
                 "type": "sample"}


@pytest.mark.parametrize("body,param", [
    ({**TINKER_SAMPLE, "beam_width": 4}, "beam_width"),
    ({**TINKER_SAMPLE, "sampling_params": {"max_tokens": 2, "min_p": 0.1}},
     "sampling_params.min_p"),
    ({**TINKER_SAMPLE, "prompt": {"chunks": [], "images": []}}, "prompt.images"),
    ({**TINKER_SAMPLE, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [33],
                                              "weight": 2}]}}, "prompt.chunks.0.weight"),
])
def test_tinker_sampling_body_refuses_unknown_fields(http: httpx.Client, body: dict,
                                                     param: str) -> None:
    _error(_post(http, "/api/v1/asample", body), param, "unknown_parameter")


def test_tinker_sdk_body_is_accepted(http: httpx.Client) -> None:
    """What the Tinker SDK sends (its SampleRequest, every field) still starts a sample."""
    body = {**TINKER_SAMPLE, "num_samples": 1, "sampling_session_id": None, "seq_id": None,
            "model_path": None, "prompt_logprobs": None, "topk_prompt_logprobs": 0,
            "sampling_params": {"max_tokens": 2, "seed": 1, "stop": None, "temperature": 1.0,
                                "top_k": -1, "top_p": 1.0}}
    r = _post(http, "/api/v1/asample", body)
    assert r.status_code == 200, r.text


# -- the effects, over the real engine -----------------------------------------------------------

MAX_MODEL_LEN = 64
VOCAB = 259  # the demo tokenizer's, which hf_dense copies


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, hf_dense) -> Iterator[tuple[str, AsyncEngine]]:
    """A live server over the tiny hf_dense base and two synthetic adapters."""
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.catalog.store import Catalog

    cat_dir = tmp_path_factory.mktemp("fields") / "catalog"
    Catalog.create(cat_dir, shards=1).close()
    assert materialize(MaterializeConfig(cat_dir, hf_dense, 2, rank=2, workers=1,
                                         progress=False)).ok
    engine = AsyncEngine.from_model_dir(str(hf_dense), catalog_dir=str(cat_dir), device="cpu",
                                        dtype="float32", max_model_len=MAX_MODEL_LEN,
                                        max_batch_size=8, max_gpu_adapters=2, max_lora_rank=16)
    with LiveServer(build_app(engine, max_n=4)) as server:
        yield server.url, engine


@pytest.fixture()
def rhttp(real: tuple[str, AsyncEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real[0], timeout=120) as c:
        yield c


ADAPTERS = ("synth/a0000000", "synth/a0000001")


def generate(http: httpx.Client, prompt: list[int], model: str,
             **fields: Any) -> tuple[list[int], str, dict]:
    """(token ids, finish reason, first position's raw top logprobs {id: logprob})."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True, **fields}
    r = _post(http, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    top = {int(t.removeprefix("token_id:")): lp
           for t, lp in (choice["logprobs"]["top_logprobs"][0] or {}).items()} if ids else {}
    return ids, choice["finish_reason"], top


@pytest.fixture(scope="module")
def base_name(real: tuple[str, AsyncEngine]) -> str:
    return real[1].model_name


PROMPT = [40, 41, 42, 43]


def test_the_base_logits_are_close_together(rhttp: httpx.Client, base_name: str) -> None:
    """The crafted cases below rest on this: the random base's logits are within 1 of each
    other (a bias of 3 or more decides a greedy pick, a penalty of 2 undoes a bias of 1)."""
    r = _post(rhttp, "/v1/completions", {"model": base_name, "prompt": PROMPT, "max_tokens": 4,
                                         "temperature": 0, "ignore_eos": True, "logprobs": 5})
    uniform = -math.log(VOCAB)
    for top in r.json()["choices"][0]["logprobs"]["top_logprobs"]:
        assert all(abs(lp - uniform) < 0.5 for lp in top.values()), top  # no token stands out


def test_logit_bias_decides_greedy_and_logprobs_stay_raw(rhttp: httpx.Client,
                                                         base_name: str) -> None:
    plain, _, raw_top = generate(rhttp, PROMPT, base_name)
    target = next(t for t in range(100, 120) if t not in plain)
    biased, _, biased_top = generate(rhttp, PROMPT, base_name, logit_bias={str(target): 100})
    assert biased == [target] * 6
    banned, _, _ = generate(rhttp, PROMPT, base_name, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    # logprobs are the model's, not the biased ones: the same top alternatives, and the biased
    # token's own near-uniform raw logprob (biased it would be ~0)
    assert {t: biased_top[t] for t in raw_top} == pytest.approx(raw_top)
    assert biased_top[target] < -3


def test_min_tokens_holds_eos_and_stop_token_ids_back(rhttp: httpx.Client, base_name: str,
                                                      real: tuple[str, AsyncEngine]) -> None:
    eos = real[1].tokenizer.eos_token_ids[0]
    eos_happy = {"logit_bias": {str(eos): 100}, "ignore_eos": False, "max_tokens": 10}
    ids, reason, _ = generate(rhttp, PROMPT, base_name, **eos_happy)
    assert (ids, reason) == ([eos], "stop")
    ids, reason, _ = generate(rhttp, PROMPT, base_name, **eos_happy, min_tokens=5)
    assert len(ids) == 6 and ids[-1] == eos and eos not in ids[:5] and reason == "stop"
    stop_happy = {"logit_bias": {"77": 100}, "stop_token_ids": [77], "max_tokens": 10}
    assert generate(rhttp, PROMPT, base_name, **stop_happy)[:2] == ([77], "stop")
    ids, reason, _ = generate(rhttp, PROMPT, base_name, **stop_happy, min_tokens=3)
    assert len(ids) == 4 and ids[-1] == 77 and 77 not in ids[:3] and reason == "stop"
    # stop strings too wait for min_tokens (vLLM): "M" is token 77's text
    r = _post(rhttp, "/v1/completions", {"model": base_name, "prompt": PROMPT, "max_tokens": 6,
                                         "temperature": 0, "logit_bias": {"77": 100},
                                         "stop": ["M"], "min_tokens": 2})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == "MM"


A, B = 100, 101  # two tokens a crafted bias puts ahead of everything else


def test_repetition_penalty_counts_the_prompt(rhttp: httpx.Client, base_name: str) -> None:
    bias = {"logit_bias": {str(A): 5, str(B): 4}}
    assert generate(rhttp, [A, 50, 51], base_name, **bias)[0][0] == A
    # A is in the prompt: (a + 5) / 2 falls below b + 4
    assert generate(rhttp, [A, 50, 51], base_name, **bias, repetition_penalty=2.0)[0][0] == B
    assert generate(rhttp, [50, 51], base_name, **bias, repetition_penalty=2.0)[0][0] == A
    # a penalty below 1 favours what was seen: B in the prompt, (b + 4) / 0.2 overtakes a + 5
    assert generate(rhttp, [B, 50], base_name, **bias, repetition_penalty=0.2)[0][0] == B
    ids = generate(rhttp, [50, 51], base_name, **bias, repetition_penalty=2.0)[0]
    assert ids[:2] == [A, B]  # A generated: seen from then on


def test_presence_and_frequency_count_output_tokens_only(rhttp: httpx.Client,
                                                         base_name: str) -> None:
    bias = {"logit_bias": {str(A): 3, str(B): 2}}
    plain = generate(rhttp, [A, 50], base_name, **bias)[0]
    assert plain == [A] * 6  # the prompt's A is not output: no presence penalty on it
    presence = generate(rhttp, [A, 50], base_name, **bias, presence_penalty=2.0)[0]
    frequency = generate(rhttp, [A, 50], base_name, **bias, frequency_penalty=2.0)[0]
    # presence: A (a+3); then A is a+1 < b+2: B; then A a+1 > b: A, and so on (both present,
    # the penalty does not grow)
    assert presence == [A, B, A, A, A, A]
    # frequency: each repeat costs 2 more: after A, B, A, A is at a-1, below the pack
    assert frequency[:3] == [A, B, A] and frequency[3] != A
    encouraged = generate(rhttp, [50, 51], base_name, logit_bias={str(A): 0.5},
                          presence_penalty=-2.0)[0]
    assert len(set(encouraged[1:])) == 1  # what was said first is said again


def test_min_p_one_is_greedy(rhttp: httpx.Client, base_name: str) -> None:
    greedy = generate(rhttp, PROMPT, base_name)[0]
    sampled = [generate(rhttp, PROMPT, base_name, temperature=1.0, seed=s)[0] for s in (1, 2)]
    assert any(s != greedy for s in sampled)  # near-uniform: sampling differs from greedy
    for s in (1, 2):
        assert generate(rhttp, PROMPT, base_name, temperature=1.0, seed=s, min_p=1.0)[0] == greedy


def test_mixed_adapter_batch_gives_each_sequence_its_own(rhttp: httpx.Client, base_name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Base and two adapters, with and without extensions, greedy and seeded, at once: each
    gets what it gets alone (and they did share sampling batches)."""
    import loraserve.engine.core.llm_engine as llm_engine

    batches: list[tuple[int, int, int]] = []  # (sequences, adapters incl. base, with extensions)

    def recording_sample(logits, seqs, *args, **kwargs):
        batches.append((len(seqs), len({s.adapter_key for s in seqs}),
                        sum(s.params.adjusts_logits for s in seqs)))
        return sample(logits, seqs, *args, **kwargs)

    mix = [
        (base_name, {}),
        (ADAPTERS[0], {"logit_bias": {str(A): 3, str(B): 2}, "frequency_penalty": 2.0}),
        (ADAPTERS[1], {"temperature": 1.0, "seed": 5}),
        (base_name, {"temperature": 1.0, "seed": 6, "min_p": 0.5, "repetition_penalty": 1.5}),
        (ADAPTERS[1], {"min_tokens": 4, "presence_penalty": 1.0, "top_k": 3,
                       "temperature": 0.7, "seed": 7}),
        (ADAPTERS[0], {}),
    ]
    alone = [generate(rhttp, PROMPT, model, max_tokens=8, **fields)[0] for model, fields in mix]
    monkeypatch.setattr(llm_engine, "sample", recording_sample)
    with ThreadPoolExecutor(len(mix)) as pool:
        together = list(pool.map(lambda mf: generate(rhttp, PROMPT, mf[0], max_tokens=8,
                                                     **mf[1])[0], mix))
    assert together == alone
    assert any(n >= 3 and adapters >= 2 and 0 < ext < n for n, adapters, ext in batches), batches
    assert alone[1][:3] == [A, B, A] and alone[1][3] != A and alone[0] != alone[1]


def test_openai_client_extra_body(real: tuple[str, AsyncEngine], base_name: str) -> None:
    eos = real[1].tokenizer.eos_token_ids[0]
    with openai.OpenAI(base_url=f"{real[0]}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        r = client.completions.create(
            model=base_name, prompt="Hello", max_tokens=10, temperature=0,
            logit_bias={str(eos): 100},
            extra_body={"min_tokens": 5, "repetition_penalty": 1.1, "min_p": 0.05, "top_k": 50})
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(
            model=ADAPTERS[0], messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
            extra_body={"logit_bias": {str(A): 100}, "stop_token_ids": [A],
                        "min_tokens": 2})
        assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=base_name, messages=[{"role": "user",
                                                                       "content": "hi"}],
                                           response_format={"type": "xml"})
        assert err.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=base_name, prompt="x",
                                      extra_body={"use_beam_search": True})
        assert err.value.body["code"] == "unknown_parameter"
