"""ModelConfig: both transformers spellings, validation, and the config.json we write."""
from __future__ import annotations

import json

import pytest

from loraserve.model import ModelConfig, ModelConfigError
from loraserve.model.tiny import tiny_config

DENSE = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "eos_token_id": 5}
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "norm_topk_prob": True}


def test_transformers4_spellings():
    cfg = ModelConfig.from_hf_dict({**MOE, "torch_dtype": "bfloat16"})
    assert (cfg.arch, cfg.num_experts, cfg.rope_theta, cfg.eos_token_ids) == ("qwen3_moe", 8, 1e6, [5])
    assert cfg.torch_dtype == "bfloat16" and cfg.is_moe


def test_transformers5_spellings():
    d = {k: v for k, v in MOE.items() if k not in ("num_experts", "rope_theta")}
    d.update(num_local_experts=8, rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
             dtype="float16", eos_token_id=[5, 6])
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.num_experts, cfg.rope_theta, cfg.torch_dtype, cfg.eos_token_ids) == (8, 5e5, "float16", [5, 6])


def test_head_dim_defaults_to_hidden_over_heads():
    d = {k: v for k, v in DENSE.items() if k != "head_dim"}
    assert ModelConfig.from_hf_dict(d).head_dim == 16


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "llama4"}, "unsupported model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"use_sliding_window": True}, "sliding"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"eos_token_id": 1000}, "eos_token_ids"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict({**DENSE, **change})


def test_missing_key_names_it():
    d = {k: v for k, v in DENSE.items() if k != "num_hidden_layers"}
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        ModelConfig.from_hf_dict(d)


def test_moe_validation():
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**MOE, "num_experts_per_tok": 9})
    with pytest.raises(ModelConfigError, match="num_experts"):
        ModelConfig.from_hf_dict({k: v for k, v in MOE.items() if k != "num_experts"})


def test_is_moe_layer_follows_transformers_rule():
    cfg = ModelConfig.from_hf_dict({**MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                    "mlp_only_layers": [3]})
    assert [cfg.is_moe_layer(l) for l in range(6)] == [False, True, False, False, False, True]
    assert not tiny_config("qwen3").is_moe_layer(0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_hf_dict_round_trip(arch):
    cfg = tiny_config(arch)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_transformers_reads_our_config(arch):
    from transformers import AutoConfig

    cfg = tiny_config(arch)
    hf = AutoConfig.for_model(**cfg.to_hf_dict())
    assert hf.model_type == arch and hf.num_hidden_layers == cfg.num_layers
    assert hf.head_dim == cfg.head_dim and hf.rope_parameters["rope_theta"] == cfg.rope_theta
    if arch == "qwen3_moe":
        assert hf.num_experts == cfg.num_experts and hf.norm_topk_prob


def test_from_dir_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="not a Hugging Face model directory"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
