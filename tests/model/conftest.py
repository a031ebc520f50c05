"""Tiny checkpoints of every supported architecture written by transformers' save_pretrained (the reference).

Weights are re-drawn with unit-scale std (transformers' default 0.02 gives near-flat logits, which
would make greedy comparisons hinge on float noise)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 96


HF_CLASSES = {  # model_type -> (transformers config class, causal-LM class)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def hf_model(arch: str, *, tie: bool = False, seed: int = 0, attn_implementation: str | None = None,
             **overrides):
    """A transformers model with tiny dims and weights that give confident logits (biases too)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=tie, eos_token_id=[1, 2])
    common.update(overrides)
    if common["head_dim"] is None:  # hidden / heads, as Llama and Qwen2 configs leave it
        del common["head_dim"]
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[arch])
    if arch == "qwen3_moe":
        common.setdefault("num_experts", 6)
        moe = dict(moe_intermediate_size=24, num_experts_per_tok=2, norm_topk_prob=True)
        moe.update({k: common.pop(k) for k in list(common) if k in moe})
        common.update(moe)
    config = config_cls(**common)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.eval()


def save_hf(model, out: Path, **kwargs) -> Path:
    model.save_pretrained(out, **kwargs)
    return out


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every model test runs on one thread (see the root conftest)."""


@pytest.fixture
def make_hf():
    """hf_model as a fixture, so tests need not import this conftest."""
    return hf_model


@pytest.fixture(scope="module")
def hf_dense_dir(tmp_path_factory) -> Path:
    return save_hf(hf_model("qwen3"), tmp_path_factory.mktemp("hf") / "dense")


@pytest.fixture(scope="module")
def hf_moe_dir(tmp_path_factory) -> Path:
    return save_hf(hf_model("qwen3_moe"), tmp_path_factory.mktemp("hf") / "moe")
