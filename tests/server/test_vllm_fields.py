"""vLLM's request fields that were 400s (issue 43, 7): `chat_template_kwargs` (the chat
template's variables, Qwen3's `enable_thinking`), `skip_special_tokens`,
`include_stop_str_in_output` and `prompt_logprobs`, honoured on both endpoints as vLLM does;
what they cannot mean is a 400 naming them.

The text options are the API side's (engine/client/output_processor.py): checked on its
processor with the demo tokenizer, then over HTTP on the random demo base with logit_bias
steering the model to the tokens that matter. prompt_logprobs are the echo's numbers, in vLLM's
shape.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.client.output_processor import OutputProcessor
from loraserve.engine.types import GenerateRequest, RequestOutput, SamplingParams
from loraserve.server import build_app
from loraserve.tokenizer import ChatTemplate, Tokenizer

from .fake_engine import FakeEngine
from .live import LiveServer

IM_START, IM_END = 257, 258  # the demo tokenizer's specials; 0-255 are bytes
# Qwen3's switch, as its template writes it after the generation prompt
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _process(tok: Tokenizer, ids: list[int], finish: str, **params: Any) -> str:
    """The text the API side makes of one delta of `ids` ending `finish`."""
    proc = OutputProcessor(tok)
    req = GenerateRequest("r", [1], SamplingParams(max_tokens=64, **params), stream=True)
    proc.add(req)
    ready, _ = proc.process([RequestOutput("r", ids, "", finish_reason=finish,
                                           num_output_tokens=len(ids))])
    return "".join(out.text for out in ready)


def test_the_text_options_on_the_processor(demo_dense) -> None:
    tok = Tokenizer.from_dir(demo_dense)
    ab = list(b"ab")
    with_special = ab[:1] + [IM_START] + ab[1:]
    assert _process(tok, with_special, "length") == "ab"
    assert _process(tok, with_special, "length", skip_special_tokens=False) == "a<|im_start|>b"
    # EOS ends it: its text is never the answer's, unless it is kept with the stop
    assert _process(tok, ab + [IM_END], "stop", skip_special_tokens=False) == "ab"
    assert _process(tok, ab + [IM_END], "stop", skip_special_tokens=False,
                    include_stop_str_in_output=True) == "ab<|im_end|>"
    # a stop token id: its text kept with include_stop_str_in_output (vLLM's rule)
    assert _process(tok, list(b"ab."), "stop", stop_token_ids=[46]) == "ab"
    assert _process(tok, list(b"ab."), "stop", stop_token_ids=[46],
                    include_stop_str_in_output=True) == "ab."
    # a stop string: cut before it, or after it; the earliest wins, text after it never kept
    assert _process(tok, list(b"x<end>yy"), "length", stop=["<end>"]) == "x"
    assert _process(tok, list(b"x<end>yy"), "length", stop=["<end>", "yy"],
                    include_stop_str_in_output=True) == "x<end>"


@pytest.fixture(scope="module")
def real(demo_dense) -> Iterator[str]:
    engine = AsyncEngine.from_model_dir(str(demo_dense), device="cpu", dtype="float32",
                                        max_model_len=512, max_batch_size=8,
                                        served_model_name="base")
    with LiveServer(build_app(engine)) as live:
        yield live.url


@pytest.fixture()
def http(real: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real, timeout=120) as c:
        yield c


def _text(http: httpx.Client, path: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "base", "max_tokens": 4, "temperature": 0, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", "Hello")
    else:
        body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_skip_special_tokens_and_include_stop_over_http(http: httpx.Client, path: str) -> None:
    def text(**fields: Any) -> str:
        choice = _text(http, path, **fields)["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    special = {"logit_bias": {str(IM_START): 100}, "ignore_eos": True}
    assert text(**special) == ""  # <|im_start|> four times: special, left out
    assert text(skip_special_tokens=False, **special) == "<|im_start|>" * 4
    x = {"logit_bias": {"120": 100}, "max_tokens": 6}  # "x" at every step
    assert text(stop=["xx"], **x) == ""
    assert text(stop=["xx"], include_stop_str_in_output=True, **x) == "xx"
    assert text(stop_token_ids=[120], include_stop_str_in_output=True, **x) == "x"


def test_prompt_logprobs_are_the_echos_in_vllms_shape(http: httpx.Client) -> None:
    prompt = "Hello there"
    body = _text(http, "/v1/completions", prompt=prompt, prompt_logprobs=2, max_tokens=1)
    entries = body["choices"][0]["prompt_logprobs"]
    ids = list(prompt.encode())
    assert len(entries) == len(ids) and entries[0] is None
    echo = _text(http, "/v1/completions", prompt=prompt, echo=True, logprobs=2, max_tokens=1)
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    for token_id, entry, logprob in zip(ids[1:], entries[1:], echoed[1:]):
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(logprob) and mine["decoded_token"] == chr(token_id)
        assert 3 >= len(entry) >= 2  # the prompt token and the top 2 (it may be one of them)
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(token_id))
        assert ranks[:2] == [1, 2] or ranks == [1] or ranks == [2]
        if mine["rank"] is not None:
            assert 1 <= mine["rank"] <= 2
    assert "prompt_logprobs" not in _text(http, "/v1/completions")["choices"][0]
    chat = _text(http, "/v1/chat/completions", prompt_logprobs=0, max_tokens=1)
    assert chat["prompt_logprobs"][0] is None
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # the prompt token alone


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM refuses it too
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "whole vocabulary": not served
    ({"skip_special_tokens": "maybe"}, "skip_special_tokens"),
])
def test_what_they_cannot_mean_is_a_400(http: httpx.Client, fields: dict, param: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": "base", "max_tokens": 2, **fields,
                **({"prompt": "x"} if path == "/v1/completions"
                   else {"messages": [{"role": "user", "content": "x"}]})}
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- chat_template_kwargs -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking(demo_dense) -> Iterator[tuple[str, Tokenizer]]:
    tok = Tokenizer.from_dir(demo_dense)
    tok._chat = ChatTemplate(THINKING, {})
    engine = FakeEngine(max_model_len=512, vocab_size=tok.vocab_size, tokenizer=tok)
    with LiveServer(build_app(engine)) as live:
        yield live.url, tok


def test_chat_template_kwargs_reach_the_template(thinking: tuple[str, Tokenizer]) -> None:
    url, tok = thinking
    messages = [{"role": "user", "content": "Hi"}]
    plain = tok.apply_chat_template(messages)
    off = tok.apply_chat_template(messages, variables={"enable_thinking": False})
    assert off == plain + "<think>\n\n</think>\n\n"
    with httpx.Client(base_url=url, timeout=60) as http:
        def prompt_tokens(**fields: Any) -> int:
            r = http.post("/v1/chat/completions", json={"model": "fake-base", "max_tokens": 1,
                                                        "messages": messages, **fields})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        assert prompt_tokens() == len(tok.encode(plain))
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == len(
            tok.encode(plain))
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == len(
            tok.encode(off))
        kwargs = {"enable_thinking": False}
        tokenized = http.post("/tokenize", json={"messages": messages,
                                                 "chat_template_kwargs": kwargs})
        assert tokenized.json()["tokens"] == tok.encode(off)
        for key in ("messages", "tools", "add_generation_prompt"):
            r = http.post("/v1/chat/completions", json={"model": "fake-base", "messages": messages,
                                                        "chat_template_kwargs": {key: 1}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}"
        r = http.post("/tokenize", json={"prompt": "x", "chat_template_kwargs": {"a": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
