"""Llama, Qwen2 and Mistral configs: both transformers spellings, window rules, refusals, the
config.json we write, and checkpoints whose tensors do not fit the architecture."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.model import ARCHS, CheckpointError, ModelConfig, ModelConfigError, load_model, save_checkpoint
from loraserve.model.config import RopeScaling
from loraserve.model.rope import inv_frequencies
from loraserve.model.tiny import random_model, tiny_config

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024, "eos_token_id": [5, 6]}
LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _cfg(model_type: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, "model_type": model_type, **extra})


def test_llama3_rope_in_both_spellings():
    published = _cfg("llama", rope_theta=5e5, rope_scaling=LLAMA31_SCALING)
    written = _cfg("llama", rope_parameters={"rope_theta": 5e5, **LLAMA31_SCALING})
    assert published == written
    assert published.rope_theta == 5e5 and published.rope_scaling.original_max_position_embeddings == 8192
    no_original = {k: v for k, v in LLAMA31_SCALING.items() if k != "original_max_position_embeddings"}
    assert _cfg("llama", rope_scaling=no_original).rope_scaling.original_max_position_embeddings == 1024


def test_llama3_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                     rope_parameters={"rope_theta": 5e5, **LLAMA31_SCALING})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = _cfg("llama", rope_theta=5e5, rope_scaling=LLAMA31_SCALING, hidden_size=4096,
                num_attention_heads=32)
    got = inv_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, inv_frequencies(128, 5e5))


def test_biases_by_family():
    llama = _cfg("llama", attention_bias=True, mlp_bias=True)
    assert (llama.qkv_bias, llama.attention_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    qwen2 = _cfg("qwen2")
    assert (qwen2.qkv_bias, qwen2.attention_bias, qwen2.mlp_bias) == (True, False, False)
    assert not _cfg("mistral", sliding_window=None).qkv_bias and _cfg("qwen3").qk_norm


def test_qwen2_window_only_with_use_sliding_window():
    assert _cfg("qwen2", sliding_window=4, max_window_layers=1).sliding_window is None
    cfg = _cfg("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert [cfg.layer_window(l) for l in range(4)] == [None, 4, 4, 4]
    written = _cfg("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=28,
                   layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    assert [written.layer_window(l) for l in range(4)] == [None, None, 4, 4]
    assert _cfg("qwen2", use_sliding_window=True).layer_window(3) is None  # default: 28 full layers
    with pytest.raises(ModelConfigError, match="layer_types"):
        _cfg("qwen2", use_sliding_window=True, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"] * 2)


def test_mistral_window_applies_to_every_layer_when_smaller_than_context():
    assert [_cfg("mistral", sliding_window=16).layer_window(l) for l in range(4)] == [16] * 4
    assert _cfg("mistral", sliding_window=None).layer_window(0) is None
    assert _cfg("mistral", sliding_window=4096).layer_window(0) is None  # >= 1024 positions: no-op
    assert _cfg("mistral").sliding_window == 4096  # transformers' default when the key is absent


@pytest.mark.parametrize("model_type, change, message", [
    ("qwen2", {"attention_bias": True}, "attention_bias=true is not supported for qwen2"),
    ("mistral", {"mlp_bias": True}, "mlp_bias=true is not supported for mistral"),
    ("qwen2", {"rope_scaling": LLAMA31_SCALING}, "rope_type 'llama3' is not supported for qwen2"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn'.*default, llama3"),
    ("llama", {"rope_scaling": {**LLAMA31_SCALING, "low_freq_factor": 4.0}}, "low_freq_factor"),
    ("llama", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window is not supported for llama"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be > 0"),
])
def test_unsupported_features_are_refused_by_name(model_type, change, message):
    with pytest.raises(ModelConfigError, match=message):
        _cfg(model_type, **change)


def test_unsupported_model_type_is_one_line_listing_the_supported():
    with pytest.raises(ModelConfigError) as err:
        _cfg("gemma2")
    text = str(err.value)
    assert "\n" not in text and "'gemma2'" in text
    assert text.endswith("supported: " + ", ".join(sorted(ARCHS)))
    assert sorted(ARCHS) == ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, eos_token_ids=[1])
WRITTEN = {
    "llama": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                  rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "qwen2": dict(sliding_window=6, max_window_layers=1),
    "mistral": dict(sliding_window=6),
}


@pytest.mark.parametrize("arch", sorted(WRITTEN))
def test_what_we_write_round_trips_and_transformers_loads_the_same_model(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **SMALL, **WRITTEN[arch])
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    model = random_model(cfg, seed=2)
    save_checkpoint(model, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.arange(2, 20)
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(len(ids))))
        torch.testing.assert_close(ref(ids[None]).logits[0], ours, rtol=1e-4, atol=1e-4)


def _resaved(src, dst, config_change: dict | None = None, tensors_change=None):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if tensors_change:
        tensors_change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config_change or {})}))
    return dst


def test_checkpoint_of_another_architecture_is_refused_naming_the_tensors(tmp_path):
    save_checkpoint(random_model(tiny_config("qwen2", **SMALL)), tmp_path / "qwen2")
    with pytest.raises(CheckpointError, match=r"has tensor 'model\.layers\.0\.self_attn\.k_proj\.bias', "
                                              r"'model\.layers\.0\.self_attn\.q_proj\.bias'.* and 1 more, "
                                              "which config.json's mistral model does not use"):
        load_model(_resaved(tmp_path / "qwen2", tmp_path / "as-mistral", {"model_type": "mistral"}))
    save_checkpoint(random_model(tiny_config("llama", **SMALL)), tmp_path / "llama")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(_resaved(tmp_path / "llama", tmp_path / "as-qwen2", {"model_type": "qwen2"}))


def test_stray_tensor_is_refused_and_rotary_buffers_are_ignored(tmp_path):
    save_checkpoint(random_model(tiny_config("llama", **SMALL)), tmp_path / "llama")

    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    load_model(_resaved(tmp_path / "llama", tmp_path / "old", tensors_change=add))

    def stray(tensors):
        tensors["model.layers.0.mlp.extra.weight"] = torch.ones(4)

    with pytest.raises(CheckpointError, match=r"has tensor 'model\.layers\.0\.mlp\.extra\.weight', which"):
        load_model(_resaved(tmp_path / "llama", tmp_path / "stray", tensors_change=stray))


def test_serve_refuses_an_unsupported_model_type_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "gemma2"}))
    out = subprocess.run([sys.executable, "-m", "loraserve.cli", "serve", "--model", str(tmp_path), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and lines[-1].startswith("loraserve serve: error:")
    assert lines[-1].endswith("unsupported model_type 'gemma2'; supported: llama, mistral, qwen2, qwen3, qwen3_moe")
