"""Llama, Qwen2 and Mistral: our decoder vs transformers on checkpoints its save_pretrained wrote
(odd sizes, GQA, tied and untied heads, biases, llama3 RoPE scaling, sliding windows)."""
from __future__ import annotations

import json

import pytest
import torch

from loraserve.model import load_model
from loraserve.model.generate import greedy_generate

VOCAB = 96  # tests/model/conftest.py
ODD = dict(vocab_size=101, hidden_size=60, intermediate_size=92, num_attention_heads=6,
           num_key_value_heads=2, head_dim=None)  # head_dim 10, 3 query heads per kv head
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)  # all three bands at D 10

CASES = {
    "llama-3.2-tied-rope-scaled": dict(arch="llama", tie=True, rope_parameters=LLAMA3_ROPE, **ODD),
    "llama-biases-sharded": dict(arch="llama", attention_bias=True, mlp_bias=True, num_hidden_layers=3,
                                 save=dict(max_shard_size="40KB"), **ODD),
    "qwen2": dict(arch="qwen2", **ODD),
    "qwen2-tied": dict(arch="qwen2", tie=True, **ODD),
    "qwen2-sliding-upper-layers": dict(arch="qwen2", use_sliding_window=True, sliding_window=5,
                                       max_window_layers=1, num_hidden_layers=3,
                                       attn_implementation="eager", **ODD),
    "mistral-head-dim-12": dict(arch="mistral", sliding_window=None, **{**ODD, "head_dim": 12}),
    "mistral-window-5": dict(arch="mistral", sliding_window=5, attn_implementation="eager", **ODD),
}


def _logprobs_ours(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).log_softmax(-1)


def _logprobs_hf(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float().log_softmax(-1)


def _assert_matches(ours, ref, n_tokens: int = 24) -> None:
    ids = torch.randint(0, VOCAB, (n_tokens,), generator=torch.Generator().manual_seed(3))
    diff = (_logprobs_ours(ours, ids) - _logprobs_hf(ref, ids)).abs().max().item()
    assert diff <= 1e-4, f"max |logprob diff| {diff}"
    prompt = ids[:7]
    with torch.no_grad():
        hf_out = ref.generate(prompt[None], max_new_tokens=10, do_sample=False,
                              attention_mask=torch.ones(1, 7, dtype=torch.long))[0, 7:].tolist()
    assert greedy_generate(ours, prompt.tolist(), 10, eos_token_ids=[1, 2]) == hf_out


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprobs_and_greedy_match_transformers(case, tmp_path, make_hf):
    spec = dict(CASES[case])
    save_kwargs = spec.pop("save", {})
    ref = make_hf(spec.pop("arch"), **spec)
    ref.save_pretrained(tmp_path, **save_kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(save_kwargs)
    ours = load_model(tmp_path)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == bool(spec.get("tie"))
    _assert_matches(ours, ref)


def test_window_smaller_than_prompt_changes_logits(make_hf, tmp_path):
    """The sliding-window case above is not vacuous: without the window the logits differ."""
    ref = make_hf("mistral", sliding_window=5, attn_implementation="eager", **ODD)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.arange(3, 27)
    windowed = _logprobs_ours(ours, ids)
    for layer in ours.model.layers:
        assert layer.self_attn.window == 5
        layer.self_attn.window = None
    assert (windowed[5:] - _logprobs_ours(ours, ids)[5:]).abs().max() > 1e-2
    torch.testing.assert_close(windowed[:5], _logprobs_ours(ours, ids)[:5])


def test_published_llama31_config_spelling(make_hf, tmp_path):
    """Published Llama 3.x configs put the scaling under `rope_scaling` and `rope_theta` at the top
    (transformers 5 writes `rope_parameters`): both give the same model."""
    ref = make_hf("llama", tie=True, rope_parameters=LLAMA3_ROPE, **ODD)
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_model(tmp_path)
    assert ours.config.rope_scaling.factor == 8.0
    _assert_matches(ours, ref)


def test_biases_are_loaded_where_the_family_has_them(make_hf, tmp_path):
    from safetensors.torch import load_file

    for arch, kw, biased in [("qwen2", {}, ("q_proj", "k_proj", "v_proj")),
                             ("llama", dict(attention_bias=True, mlp_bias=True),
                              ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
                             ("mistral", {}, ())]:
        make_hf(arch, **kw, **ODD).save_pretrained(tmp_path / arch)
        stored = load_file(tmp_path / arch / "model.safetensors")
        layer = load_model(tmp_path / arch).model.layers[1]
        for kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            owner = layer.self_attn if kind[0] in "qkvo" else layer.mlp
            bias = getattr(owner, kind).bias
            name = f"model.layers.1.{'self_attn' if kind[0] in 'qkvo' else 'mlp'}.{kind}.bias"
            assert (bias is not None) == (kind in biased), (arch, kind)
            if bias is not None:
                assert torch.equal(bias, stored[name]) and bias.abs().sum() > 0


def test_stored_head_of_a_tied_config_is_the_head_as_in_transformers(make_hf, tmp_path):
    """transformers 5 uses a stored lm_head.weight even where config.json says tied."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    make_hf("qwen2", tie=True, **ODD).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"]) * 0.3
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(tmp_path)
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    _assert_matches(ours, AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval())
