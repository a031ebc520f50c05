"""POST /tokenize and /detokenize (vLLM's shapes): the ids are those generation sends the engine,
`model` resolves as generation's does (tenants, the one 404), vLLM's fields are honoured or
refused by name."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loraserve.server import build_app

from .fake_engine import EOS_ID, FakeEngine, FakeTokenizer
from .live import LiveServer


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(adapters=("acme/support", "other/secret"))


@pytest.fixture(scope="module")
def keyed(engine: FakeEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server with a user key of tenant acme only (`acme-key`)."""
    from loraserve.keys import digest
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(f'[keys.acme]\nsha256 = "{digest("acme-key").hex()}"\nrole = "user"\n'
                    'tenants = ["acme"]\n')
    with LiveServer(build_app(engine, keys=keys)) as live:
        yield live.url


def test_prompt_tokens_are_what_completions_sends(http: httpx.Client, engine: FakeEngine) -> None:
    r = http.post("/tokenize", json={"model": "fake-base", "prompt": "Hi there"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = FakeTokenizer().encode("Hi there")
    assert body == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    before = len(engine.requests)
    done = http.post("/v1/completions", json={"model": "fake-base", "prompt": "Hi there",
                                              "max_tokens": 1})
    assert done.status_code == 200
    assert engine.requests[before].prompt_token_ids == body["tokens"]


def test_messages_go_through_the_chat_template(http: httpx.Client, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Who are you?"}]
    r = http.post("/tokenize", json={"model": "acme/support", "messages": messages})
    assert r.status_code == 200, r.text
    before = len(engine.requests)
    done = http.post("/v1/chat/completions", json={"model": "acme/support", "messages": messages,
                                                   "max_tokens": 1})
    assert done.status_code == 200
    assert engine.requests[before].prompt_token_ids == r.json()["tokens"]
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert bare.json()["tokens"] == FakeTokenizer().encode("user: Who are you?\n")


def test_token_strs_and_detokenize_round_trip(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
    assert r.json()["token_strs"] == ["a", " ", "b"]
    back = http.post("/detokenize", json={"model": "acme/support", "tokens": r.json()["tokens"]})
    assert back.status_code == 200
    assert back.json() == {"prompt": "a b"}
    special = http.post("/detokenize", json={"tokens": [33, EOS_ID]})
    assert special.json() == {"prompt": "A<special95>"}  # special tokens kept, as vLLM's


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
     "add_special_tokens", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"},
     "chat_template", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message", "unsupported_parameter"),
    ({"prompt": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "unknown_parameter"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages", "invalid_request"),
    ({"model": "fake-base"}, "prompt", "invalid_request"),
])
def test_refused_fields_are_named(http: httpx.Client, body: dict, param: str, code: str) -> None:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if code != "invalid_request":
        assert r.json()["error"]["code"] == code


def test_accepted_defaults(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": "x", "add_special_tokens": False, "tools": []})
    assert r.status_code == 200 and r.json()["tokens"] == [88]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_follow_the_chat_endpoints_rule(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "x"}]
    on_prompt = http.post("/tokenize", json={"prompt": "x", "tools": [TOOL]})
    assert on_prompt.status_code == 400 and on_prompt.json()["error"]["param"] == "tools"
    # the fake's template renders no tools: the chat endpoint's 400, word for word
    tok = http.post("/tokenize", json={"messages": messages, "tools": [TOOL]})
    chat = http.post("/v1/chat/completions", json={"model": "fake-base", "messages": messages,
                                                   "tools": [TOOL]})
    assert tok.status_code == chat.status_code == 400
    assert tok.json()["error"] == chat.json()["error"]


def test_tools_are_rendered_as_chat_renders_them(demo_dense) -> None:
    """With the demo base's real tokenizer (Qwen3's template, which renders tools), /tokenize's
    ids are the chat endpoint's prompt ids, tools included."""
    from loraserve.server.chat import CHAT_COMPLETIONS
    from loraserve.server.protocol import ChatCompletionRequest
    from loraserve.server.tokenize import TokenizeRequest, tokenize
    from loraserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(demo_dense)
    engine = FakeEngine(max_model_len=4096, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = tokenize(TokenizeRequest(messages=messages, tools=[TOOL]), engine)["tokens"]
    without = tokenize(TokenizeRequest(messages=messages), engine)["tokens"]
    chat = CHAT_COMPLETIONS.plan(ChatCompletionRequest(model="qwen3", messages=messages,
                                                       tools=[TOOL], max_tokens=8), engine)
    assert with_tools == chat.prompts[0].token_ids
    assert len(with_tools) > len(without)  # the tool's definition is in the prompt


def test_bad_ids_and_long_text_are_400(http: httpx.Client, engine: FakeEngine) -> None:
    r = http.post("/detokenize", json={"tokens": [1, 100]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    long = http.post("/tokenize", json={"prompt": "x" * (engine.max_model_len * 64)})
    assert long.status_code == 400
    assert long.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_the_standard_404(http: httpx.Client) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = http.post(path, json={"model": "acme/nothing", **body})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["message"] == "The model `acme/nothing` does not exist."


def test_tenants_apply(keyed: str) -> None:
    with httpx.Client(base_url=keyed, timeout=30) as c:
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        auth = {"Authorization": "Bearer acme-key"}
        own = c.post("/tokenize", headers=auth, json={"model": "acme/support", "prompt": "x"})
        assert own.status_code == 200
        other = c.post("/tokenize", headers=auth, json={"model": "other/secret", "prompt": "x"})
        missing = c.post("/tokenize", headers=auth, json={"model": "other/none", "prompt": "x"})
        assert other.status_code == missing.status_code == 404
        assert other.json()["error"]["message"] == "The model `other/secret` does not exist."
