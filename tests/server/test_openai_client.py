"""The official openai client against a live server over the fake engine."""
from __future__ import annotations

import openai
import pytest

from .fake_engine import FakeEngine


def expected_text(engine: FakeEngine, prompt: str, n_tokens: int, seed: int = 0,
                  adapter: bool = False) -> str:
    base = sum(engine.tokenizer.encode(prompt)) + seed + (3 if adapter else 0)
    return "".join(chr(65 + (base + 7 * k) % 26) for k in range(n_tokens))


def test_completion_text_and_usage(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.completions.create(model="fake-base", prompt="hello", max_tokens=5)
    assert r.object == "text_completion" and r.model == "fake-base"
    assert r.choices[0].text == expected_text(engine, "hello", 5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)


def test_prompt_list_with_n_is_prompt_major(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.completions.create(model="fake-base", prompt=["ab", "xyz"], n=2, max_tokens=3,
                                  seed=10)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts == [expected_text(engine, "ab", 3, 10), expected_text(engine, "ab", 3, 11),
                     expected_text(engine, "xyz", 3, 10), expected_text(engine, "xyz", 3, 11)]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_token_id_prompts(client: openai.OpenAI, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("hi")
    single = client.completions.create(model="fake-base", prompt=ids, max_tokens=2)
    batch = client.completions.create(model="fake-base", prompt=[ids, ids], max_tokens=2)
    assert single.choices[0].text == expected_text(engine, "hi", 2)
    assert [c.text for c in batch.choices] == [single.choices[0].text] * 2


def test_echo_prompt_logprobs_with_zero_max_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake-base", prompt="abcd", max_tokens=0, echo=True,
                                  logprobs=2)
    choice = r.choices[0]
    assert choice.text == "abcd" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == ["a", "b", "c", "d"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([-1.0, -1.1, -1.2])
    assert lp.top_logprobs[1] == pytest.approx({"b": -1.0, "c": -2.0})
    assert lp.text_offset == [0, 1, 2, 3]


def test_echo_with_generated_logprobs(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.completions.create(model="fake-base", prompt="ab", max_tokens=3, echo=True,
                                  logprobs=0)
    gen = expected_text(engine, "ab", 3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "ab" + gen
    assert lp.tokens == ["a", "b", *gen]
    assert lp.token_logprobs[2:] == pytest.approx([-0.5, -0.51, -0.52])
    assert lp.text_offset == [0, 1, 2, 3, 4]


def test_return_tokens_as_token_ids(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.completions.create(model="fake-base", prompt="ab", max_tokens=2, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    ids = engine.tokenizer.encode(expected_text(engine, "ab", 2))
    assert r.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]


def test_stop_string(client: openai.OpenAI, engine: FakeEngine) -> None:
    full = expected_text(engine, "stop", 8)
    stop = full[3]
    r = client.completions.create(model="fake-base", prompt="stop", max_tokens=8, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_completion_stream(client: openai.OpenAI, engine: FakeEngine) -> None:
    chunks = list(client.completions.create(model="fake-base", prompt=["ab", "cd"], n=2,
                                            max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: expected_text(engine, "ab", 4), 1: expected_text(engine, "ab", 4),
                     2: expected_text(engine, "cd", 4), 3: expected_text(engine, "cd", 4)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_stream_echo_logprobs(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="fake-base", prompt="xyz", max_tokens=2,
                                            echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text.startswith("xyz")
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens[:3] == ["x", "y", "z"] and len(tokens) == 5 and offsets == [0, 1, 2, 3, 4]


def test_chat(client: openai.OpenAI, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake-base", messages=messages, max_tokens=4)
    prompt = "system: be brief\nuser: hi\nassistant:"
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(engine, prompt, 4)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4


def test_chat_default_max_tokens_fills_context(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.chat.completions.create(model="fake-base",
                                       messages=[{"role": "user", "content": "x"}])
    assert r.usage.total_tokens == engine.max_model_len and r.choices[0].finish_reason == "length"


def test_chat_logprobs(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.chat.completions.create(model="fake-base", max_tokens=2, logprobs=True,
                                       top_logprobs=3,
                                       messages=[{"role": "user", "content": "q"}])
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert content[0].logprob == pytest.approx(-0.5)
    assert content[0].bytes == list(content[0].token.encode())
    assert [t.logprob for t in content[1].top_logprobs] == pytest.approx([-0.51, -1.51, -2.51])


def test_chat_stream(client: openai.OpenAI, engine: FakeEngine) -> None:
    stream = client.chat.completions.create(model="fake-base", max_tokens=3, stream=True, n=2,
                                            messages=[{"role": "user", "content": "hey"}])
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert {c.choices[0].delta.role for c in chunks[:2]} == {"assistant"}
    text = {0: "", 1: ""}
    for c in chunks:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    want = expected_text(engine, "user: hey\nassistant:", 3)
    assert text == {0: want, 1: want}
    assert sorted(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason) == \
        ["length", "length"]


def test_adapter_model_reaches_engine(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.completions.create(model="acme/support@r1", prompt="ab", max_tokens=2)
    assert r.model == "acme/support@r1"
    assert r.choices[0].text == expected_text(engine, "ab", 2, adapter=True)
    assert engine.requests[-1].adapter == "acme/support@r1"


def test_model_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown_name:
        client.completions.create(model="gpt-4", prompt="ab", max_tokens=2)
    assert unknown_name.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="acme/nothing", max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.ConflictError):
        client.completions.create(model="acme/mismatch", prompt="ab", max_tokens=2)
    assert client.completions.create(model="fake-base", prompt="ab", max_tokens=1).choices


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["fake-base", "acme/support"]
    assert client.models.retrieve("acme/support").id == "acme/support"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
