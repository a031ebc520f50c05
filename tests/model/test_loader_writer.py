"""Loader and writer: round trips, sharding, dtypes, and clear errors on bad checkpoints."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.model import CheckpointError, load_model, resolve_dtype, save_checkpoint
from loraserve.model.tiny import random_model, tiny_config

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
             num_kv_heads=1, head_dim=16, eos_token_ids=[1])
SMALL_MOE = dict(SMALL, num_experts=4, moe_intermediate_size=16)


def _small(arch: str = "qwen3", **kw):
    return random_model(tiny_config(arch, **(SMALL_MOE if arch == "qwen3_moe" else SMALL), **kw), seed=7)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("shard", [None, 6000])
def test_write_then_load_round_trip(tmp_path, arch, shard):
    model = _small(arch)
    save_checkpoint(model, tmp_path, max_shard_bytes=shard)
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        assert not (tmp_path / "model.safetensors").exists()
    loaded = load_model(tmp_path)
    assert _same_weights(model, loaded)
    assert not any(p.requires_grad for p in loaded.parameters())


def test_writer_stores_experts_per_expert_and_omits_tied_head(tmp_path):
    model = _small("qwen3_moe", tie_word_embeddings=True)
    save_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert torch.equal(tensors["model.layers.1.mlp.experts.2.down_proj.weight"],
                       model.model.layers[1].mlp.experts.down_proj.weight[2])
    assert not any(".experts.down_proj" in k for k in tensors)
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert _same_weights(model, loaded)


def test_writer_is_deterministic(tmp_path):
    for d in ("a", "b"):
        save_checkpoint(_small("qwen3_moe"), tmp_path / d, max_shard_bytes=20000)
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_missing_lm_head_means_tied(tmp_path):
    model = _small()
    save_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_checkpoint_written_and_loaded(tmp_path, dtype):
    model = _small("qwen3_moe").to(dtype)
    save_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    assert _same_weights(model, load_model(tmp_path, dtype=dtype))
    as32 = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(as32.model.embed_tokens.weight, model.model.embed_tokens.weight.float())


def test_missing_tensor_is_named(tmp_path):
    save_checkpoint(_small("qwen3_moe"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.gate_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.3\.gate_proj"):
        load_model(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
    save_checkpoint(_small(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \[8, 32\], expected \[16, 32\]"):
        load_model(tmp_path)


def test_missing_shard_and_pickle_only(tmp_path):
    save_checkpoint(_small(), tmp_path / "sharded", max_shard_bytes=6000)
    (tmp_path / "sharded" / "model-00002-of-{:05d}.safetensors".format(
        len(list((tmp_path / "sharded").glob("model-*"))))).unlink()
    with pytest.raises(CheckpointError, match="shard model-00002"):
        load_model(tmp_path / "sharded")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(tiny_config("qwen3", **SMALL).to_hf_dict()))
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model(pickled)


def test_resolve_dtype():
    cfg = tiny_config("qwen3", torch_dtype="float16")
    assert resolve_dtype("auto", cfg, "cpu") == torch.float32
    assert resolve_dtype("auto", cfg, "cuda") == torch.float16
    assert resolve_dtype("auto", tiny_config("qwen3", torch_dtype=None), "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", cfg, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float64", cfg, "cpu")
