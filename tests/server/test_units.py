"""Server pieces without a live server: error mapping, fan-out, logprob shapes, streams."""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import openai
import pytest
from fastapi.exceptions import RequestValidationError

from loraserve.catalog.errors import (AdapterNotFound, BaseMismatch, CatalogError, CorruptBlob,
                            InvalidAdapterId)
from loraserve.engine.types import EngineError, SamplingParams, TokenLogprob
from loraserve.server.config import ServerConfig
from loraserve.server.errors import APIError, as_api_error, validation_error
from loraserve.server.logprobs import LOGPROB_FLOOR, LegacyLogprobs, TokenRenderer, chat_content
from loraserve.server.endpoint import Endpoint, Plan, serve
from loraserve.server.protocol import CompletionRequest
from loraserve.engine.directory import EVERYONE
from loraserve.engine.types import ResolvedModel
from loraserve.keys import Principal
from loraserve.server.serving import Prompt, ServerContext, fan_out, resolve_model
from loraserve.server.metrics import ServerMetrics
from loraserve.server.streaming import merge, start_all

from .fake_engine import FakeEngine, FakeTokenizer


@pytest.mark.parametrize("exc,status,code", [
    (AdapterNotFound("no acme/x"), 404, "adapter_not_found"),
    (InvalidAdapterId("bad id"), 400, "invalid_adapter_id"),
    (BaseMismatch("fp differs"), 409, "base_mismatch"),
    (CorruptBlob("checksum"), 500, "corrupt_blob"),
    (EngineError("busy", status=503, code="overloaded"), 503, "overloaded"),
    (KeyError("bug"), 500, "internal_error"),
])
def test_error_mapping(exc: Exception, status: int, code: str) -> None:
    error = as_api_error(exc)
    assert (error.status, error.code) == (status, code)
    body = error.body()["error"]
    assert body["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert body["message"]


def test_validation_error_names_the_field() -> None:
    exc = RequestValidationError([{"type": "missing", "loc": ("body", "messages", 2, "role"),
                                   "msg": "Field required"}])
    error = validation_error(exc)
    assert (error.status, error.param) == (400, "messages.2.role")


def test_resolve_model() -> None:
    """The server asks the engine's directory once per request: the base, an adapter (its
    tenant with it), and the one 404 for names that are no id, name nothing, or name another
    tenant's adapter."""
    engine = FakeEngine()
    resolve = lambda name, who=EVERYONE: asyncio.run(resolve_model(name, who, engine))  # noqa: E731
    assert resolve("fake-base").is_base
    got = resolve("acme/support@r1")
    assert (got.ref, got.adapter, got.tenant) == ("acme/support@r1", ("acme/support", "r1"), "acme")
    other = Principal("k", admin=False, tenants=("beta",))
    for name, who in [*((n, EVERYONE) for n in ("gpt-4", "a/b/c", "acme/../x", "t/n@", "t/n@a@b",
                                                 "x" * 65 + "/n", "acme/ghost")),
                      ("acme/support", other)]:
        with pytest.raises(APIError) as err:
            resolve(name, who)
        assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")
        assert name[:40] in err.value.message


def _adapter(ref: str) -> ResolvedModel:
    adapter_id, _, rev = ref.partition("@")
    return ResolvedModel(ref, ref, (adapter_id, rev or "r1"), None, adapter_id.split("/")[0])


BASE = ResolvedModel("fake-base", "fake-base")


def test_fan_out_is_prompt_major_with_seed_per_choice() -> None:
    params = SamplingParams(max_tokens=3, seed=7, stop=["x"])
    prompts = [Prompt("a", [1]), Prompt("b", [2])]
    reqs = fan_out("cmpl-1", prompts, 3, params, _adapter("t/n"), 1.0)
    assert [r.request_id for r in reqs] == [f"cmpl-1-{i}" for i in range(6)]
    assert [r.prompt_token_ids for r in reqs] == [[1]] * 3 + [[2]] * 3
    assert [r.params.seed for r in reqs] == [7, 8, 9] * 2
    assert all(r.params.stop == ["x"] and r.adapter == "t/n" for r in reqs)
    unseeded = fan_out("c", prompts[:1], 2, SamplingParams(), BASE, 1.0)
    assert [r.params.seed for r in unseeded] == [None, None]


def test_server_context_rejects_bad_max_n() -> None:
    with pytest.raises(ValueError):
        ServerContext(engine=FakeEngine(), metrics=ServerMetrics(), config=ServerConfig(max_n=0))


def test_logprob_shapes_floor_infinities() -> None:
    render = TokenRenderer(FakeTokenizer())
    entries = [None, TokenLogprob(34, -math.inf, {34: -math.inf, 35: -1.0, 36: -2.0})]
    lp = LegacyLogprobs()
    end = lp.extend([33, 34], entries, render, offset=5, top_k=1)
    assert end == 7 and lp.text_offset == [5, 6]
    assert lp.token_logprobs == [None, LOGPROB_FLOOR]
    assert lp.top_logprobs == [None, {"B": LOGPROB_FLOOR, "C": -1.0}]
    content = chat_content([35], [TokenLogprob(35, -0.5, {35: -0.5, 1: -3.0})], render, 2)
    assert content == [{"token": "C", "logprob": -0.5, "bytes": [67],
                        "top_logprobs": [{"token": "C", "logprob": -0.5, "bytes": [67]},
                                         {"token": "!", "logprob": -3.0, "bytes": [33]}]}]
    assert TokenRenderer(FakeTokenizer(), as_token_ids=True)(35) == "token_id:35"


def test_start_all_closes_every_request_when_one_fails() -> None:
    engine = FakeEngine()
    good = fan_out("r", [Prompt("a", [1])], 2, SamplingParams(max_tokens=5), BASE, 1.0)
    bad = fan_out("b", [Prompt("a", [1])], 1, SamplingParams(max_tokens=5), _adapter("acme/ghost"),
                  1.0)

    async def run() -> None:
        with pytest.raises(CatalogError):
            await start_all(engine, good + bad)

    asyncio.run(run())
    assert sorted(engine.aborted) == ["r-0", "r-1"] and engine.running == 0


def test_closing_merge_aborts_unfinished_requests() -> None:
    engine = FakeEngine(delay_s=0.001)
    reqs = fan_out("m", [Prompt("a", [1])], 3, SamplingParams(max_tokens=50), BASE, 1.0)

    async def run() -> list[int]:
        stream = merge(await start_all(engine, reqs))
        seen = [(await stream.__anext__())[0] for _ in range(4)]
        await stream.aclose()
        return seen

    assert len(asyncio.run(run())) == 4
    assert sorted(engine.aborted) == ["m-0", "m-1", "m-2"]


def test_error_mid_stream(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.fail_mid_stream = RuntimeError("engine died")
    with pytest.raises(openai.APIError) as err:
        list(client.completions.create(model="fake-base", prompt="ab", max_tokens=5,
                                       stream=True))
    assert "RuntimeError" in str(err.value.message)
    engine.fail_mid_stream = RuntimeError("engine died")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="fake-base", max_tokens=5,
                                       messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model="fake-base", prompt="ab", max_tokens=2).choices


@dataclass(slots=True)
class CountingChoice:
    """A toy endpoint's choice: counts deltas, opens its stream with a marker entry."""

    index: int
    num_tokens: int = 0

    def apply(self, out) -> None:
        self.num_tokens += len(out.token_ids)

    def delta(self, out) -> dict:
        self.apply(out)
        return {"index": self.index, "n": len(out.token_ids)}

    def opening(self) -> dict:
        return {"index": self.index, "open": True}

    def to_json(self) -> dict:
        return {"index": self.index, "tokens": self.num_tokens}


TOY = Endpoint("toy",
               lambda req, engine, config: Plan([Prompt("ab", [1, 2])], SamplingParams(max_tokens=req.max_tokens),
                                        lambda i, prompt, render: CountingChoice(i)),
               lambda request_id, created, model, chunk: {"id": request_id, "chunk": chunk})


def test_the_skeleton_serves_any_endpoint() -> None:
    """An endpoint supplies its plan, head and choices; the skeleton does the rest."""
    ctx = ServerContext(engine=FakeEngine(), metrics=ServerMetrics(), config=ServerConfig(max_n=4))

    async def answer(**fields) -> tuple[int, bytes | list[str]]:
        req = CompletionRequest(model="fake-base", prompt="unused", max_tokens=3, n=2, **fields)
        response = await serve(req, ctx, TOY, EVERYONE)
        if not fields.get("stream"):
            return response.status_code, response.body
        return response.status_code, [chunk async for chunk in response.body_iterator]

    status, body = asyncio.run(answer())
    data = json.loads(body)
    assert status == 200 and data["id"].startswith("toy-") and data["chunk"] is False
    assert data["choices"] == [{"index": 0, "tokens": 3}, {"index": 1, "tokens": 3}]
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    status, events = asyncio.run(answer(stream=True, stream_options={"include_usage": True}))
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n" and all(c["chunk"] is True for c in chunks)
    assert [c["choices"] for c in chunks[:2]] == [[{"index": 0, "open": True}], [{"index": 1, "open": True}]]
    assert sum(len(c["choices"]) for c in chunks[2:-1]) == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    with pytest.raises(APIError) as err:
        asyncio.run(answer(guided_whitespace_pattern=" "))  # shared checks first
    assert err.value.param == "guided_whitespace_pattern"
