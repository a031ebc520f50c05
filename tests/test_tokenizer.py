"""Tokenizer: byte-level ids, specials, chat templates, EOS ids and incremental detokenizing."""
from __future__ import annotations

import json

import pytest

from loraserve.model.tiny import write_tokenizer_files
from loraserve.tokenizer import Tokenizer, TokenizerError


@pytest.fixture
def tok_dir(tmp_path):
    write_tokenizer_files(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 256}))
    return tmp_path


@pytest.fixture
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_byte_level_round_trip(tok):
    text = "héllo wörld ✓ 🦜\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 259


def test_specials_in_text_and_decode(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids == [257, ord("h"), ord("i"), 258]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.token_text(258) == "<|im_end|>" and tok.token_text(ord("a")) == "a"
    assert tok.encode("") == []


def test_eos_ids_union_of_sources(tok):
    # config.json (256), generation_config.json (258, 256), tokenizer_config eos_token (258)
    assert tok.eos_token_ids == [256, 258]


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_chat_errors(tok, tok_dir):
    with pytest.raises(TokenizerError, match="content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(TokenizerError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match="'role'"):
        tok.apply_chat_template([{"content": "x"}])
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(tok_dir).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sources_and_tojson(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": "{{ messages | tojson }}{{ eos_token }}"}]
    cfg["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = Tokenizer.from_dir(tok_dir).apply_chat_template([{"role": "user", "content": "<é>"}])
    assert out == '[{"role": "user", "content": "<é>"}]<|im_end|>'
    del cfg["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tok_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert Tokenizer.from_dir(tok_dir).apply_chat_template([{"role": "user", "content": ""}]) == "[user]"


def test_bad_template_is_clear(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_dir(tok_dir)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_decode_rejects_negative_ids(tok):
    with pytest.raises(TokenizerError, match=">= 0"):
        tok.decode([-1])


def test_detokenizer_holds_back_incomplete_utf8(tok):
    text = "a✓🦜b"
    det = tok.detokenizer()
    deltas = [det.step(i) for i in tok.encode(text) + [258]]
    assert deltas == ["a", "", "", "✓", "", "", "", "🦜", "b", ""]
    assert det.text == text and det.flush() == ""


def test_detokenizer_flushes_dangling_bytes(tok):
    det = tok.detokenizer()
    assert det.step(ord("x")) == "x"
    assert det.step(0xE2) == ""                       # first byte of a 3-byte character
    assert det.flush() == "\ufffd"
    assert det.text == "x\ufffd"


def test_detokenizer_gives_up_on_endless_invalid_bytes(tok):
    det = tok.detokenizer()
    out = "".join(det.step(0xFF) for _ in range(20))  # 0xFF never starts valid UTF-8
    assert out and set(out) == {"\ufffd"}


def test_detokenizer_keeps_specials_when_asked(tok):
    det = tok.detokenizer(skip_special_tokens=False)
    assert [det.step(i) for i in (ord("o"), ord("k"), 258)] == ["o", "k", "<|im_end|>"]
