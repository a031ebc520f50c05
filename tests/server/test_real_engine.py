"""The server over the real AsyncEngine on the tiny demo base (CPU), openai client end to end."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from loraserve.demo import build_demo_base
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .live import LiveServer
from .test_auth_metrics_lifecycle import samples

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, AsyncEngine]]:
    model_dir = build_demo_base(tmp_path_factory.mktemp("server-demo") / "qwen3")
    # small blocks and a 16-token prefill budget: chunked prefill and the prefix cache are in
    # play for every test here
    engine = AsyncEngine.from_model_dir(str(model_dir), device="cpu", dtype="float32",
                                        max_model_len=MAX_MODEL_LEN, max_batch_size=8,
                                        max_batched_tokens=16, block_size=4)
    with LiveServer(build_app(engine, max_n=4)) as server:
        yield server, engine


@pytest.fixture()
def client(live: tuple[LiveServer, AsyncEngine]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def test_completions_greedy_stream_matches_non_stream(client: openai.OpenAI,
                                                      live: tuple[LiveServer, AsyncEngine]) -> None:
    name = live[1].model_name
    kw = dict(model=name, prompt="Hello there", max_tokens=6, temperature=0, logprobs=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert full.choices[0].text == "".join(c.choices[0].text for c in chunks)
    streamed_tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert full.choices[0].logprobs.tokens == streamed_tokens
    assert full.usage.completion_tokens == len(streamed_tokens) > 0


def test_echo_prompt_logprobs(client: openai.OpenAI, live: tuple[LiveServer, AsyncEngine]) -> None:
    engine = live[1]
    ids = engine.tokenizer.encode("one two three")
    r = client.completions.create(model=engine.model_name, prompt=ids, max_tokens=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])


def test_chat_and_seeded_n(client: openai.OpenAI, live: tuple[LiveServer, AsyncEngine]) -> None:
    name = live[1].model_name
    messages = [{"role": "user", "content": "Who are you?"}]
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=5, n=2, seed=3,
                                       logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(model=name, messages=messages, max_tokens=5, n=2,
                                           seed=3, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    assert [c.index for c in r.choices] == [0, 1]
    assert all(len(t.top_logprobs) == 2 for c in r.choices for t in c.logprobs.content)
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=4,
                                                 stream=True, temperature=0))
    assert chunks[0].choices[0].delta.role == "assistant"


def test_bad_input_then_good(live: tuple[LiveServer, AsyncEngine]) -> None:
    server, engine = live
    good = {"model": engine.model_name, "prompt": "hi", "max_tokens": 2}
    bad = [({**good, "prompt": [engine.vocab_size]}, 400),
           ({**good, "prompt": [5, -1], "echo": True}, 400),
           ({"model": engine.model_name, "messages": []}, 400),
           ({**good, "max_tokens": MAX_MODEL_LEN}, 400),
           ({**good, "model": "acme/ghost"}, 404),
           ({**good, "model": "gpt-4"}, 404)]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for body, status in bad:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = http.post(path, json=body)
            assert r.status_code == status and set(r.json()["error"]) >= {"message", "code"}
            assert http.post("/v1/completions", json=good).status_code == 200
        m = http.get("/metrics").text
    assert "loraserve_kv_cache_usage" in m and 'loraserve_requests_total{status="404"}' in m


def test_long_prompt_chunked_and_cached_gives_one_answer(client: openai.OpenAI,
                                                         live: tuple[LiveServer, AsyncEngine]) -> None:
    """A 60-token prompt (four prefill chunks) asked three times, streamed and not, next to
    other requests: the same greedy text each time; the repeats reuse cached prefix blocks."""
    engine = live[1]
    prompt = " ".join(f"w{i}" for i in range(20))
    assert len(engine.tokenizer.encode(prompt)) > 48
    kw = dict(model=engine.model_name, prompt=prompt, max_tokens=8, temperature=0)
    hits = engine.transport.engine.blocks.prefix_hit_tokens
    first = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    again = client.completions.create(**{**kw, "n": 2}).choices
    assert streamed == first and [c.text for c in again] == [first, first]
    assert engine.transport.engine.blocks.prefix_hit_tokens > hits
    # /metrics counts them as vLLM does, in tokens: the engine's own totals, published when idle
    blocks = engine.transport.engine.blocks
    m = samples(httpx.get(f"{live[0].url}/metrics", timeout=30).text)
    assert m[("loraserve_prefix_cache_hits_total", ())] == blocks.prefix_hit_tokens
    assert m[("loraserve_prefix_cache_queries_total", ())] == blocks.prefix_query_tokens
    assert blocks.prefix_query_tokens > blocks.prefix_hit_tokens > hits
