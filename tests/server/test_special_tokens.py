"""A completion prompt gets the tokenizer's special tokens, as vLLM's and transformers' do: a
model whose tokenizer adds a BOS (Llama 3's `<|begin_of_text|>`) sees it before the text, unless
the request says `add_special_tokens: false`; a chat prompt never (its template writes them)."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
from tokenizers import Tokenizer, processors

from loraserve.demo import build_demo_base
from loraserve.model.tiny import IM_START_ID
from loraserve.tokenizer import Tokenizer as LoraserveTokenizer

BOS = "<|im_start|>"  # the tiny tokenizer's special token standing in for a BOS


@pytest.fixture(scope="module")
def bos_base(tmp_path_factory):
    """The demo base with a tokenizer whose post-processor adds a BOS before every text."""
    base = tmp_path_factory.mktemp("bos") / "base"
    shutil.copytree(build_demo_base(tmp_path_factory.mktemp("demo")), base)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, IM_START_ID)])
    tok.save(str(base / "tokenizer.json"))
    return base


def test_the_tokenizer_adds_specials_only_when_asked(bos_base):
    tok = LoraserveTokenizer.from_dir(bos_base)
    assert tok.encode("hi") == [ord("h"), ord("i")]
    assert tok.encode("hi", add_special_tokens=True) == [IM_START_ID, ord("h"), ord("i")]


@pytest.fixture(scope="module")
def served(bos_base):
    from loraserve.engine.async_engine import AsyncEngine
    from loraserve.server import build_app

    from .live import LiveServer

    engine = AsyncEngine.from_model_dir(str(bos_base), device="cpu", dtype="float32", max_model_len=128,
                                        max_batch_size=4)
    with LiveServer(build_app(engine)) as server:
        yield server


def _prompt_tokens(http: httpx.Client, body: dict) -> int:
    r = http.post("/v1/completions", json={"model": "base", "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_completions_and_tokenize_add_the_bos_as_vllm_does(served):
    with httpx.Client(base_url=served.url, timeout=60) as http:
        assert _prompt_tokens(http, {"prompt": "hello"}) == 6
        assert _prompt_tokens(http, {"prompt": "hello", "add_special_tokens": False}) == 5
        assert _prompt_tokens(http, {"prompt": [104, 105]}) == 2  # ids are taken as given
        r = http.post("/tokenize", json={"prompt": "hi"})
        assert r.json()["tokens"] == [IM_START_ID, ord("h"), ord("i")]
        r = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
        assert r.json()["tokens"] == [ord("h"), ord("i")]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert chat.count(IM_START_ID) == 2  # the template's own two turns, no extra BOS
        bad = http.post("/v1/completions", json={"model": "base", "prompt": "x", "add_special_tokens": "perhaps"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
