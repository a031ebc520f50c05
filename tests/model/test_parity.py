"""Our model vs transformers on checkpoints that transformers' save_pretrained wrote."""
from __future__ import annotations

import pytest
import torch

from loraserve.model import load_model
from loraserve.model.generate import greedy_generate

VOCAB = 96  # tests/model/conftest.py

CASES = {
    "dense": dict(arch="qwen3"),
    "dense-tied": dict(arch="qwen3", tie=True),
    "dense-sharded": dict(arch="qwen3", save=dict(max_shard_size="40KB")),
    "moe": dict(arch="qwen3_moe"),
    "moe-sharded-tied": dict(arch="qwen3_moe", tie=True, save=dict(max_shard_size="30KB")),
    "moe-mixed-layers": dict(arch="qwen3_moe", num_hidden_layers=3, decoder_sparse_step=2,
                             mlp_only_layers=[2], norm_topk_prob=False, num_experts=5),
}


def _logprobs_ours(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(ids)))
        return model.compute_logits(hidden).log_softmax(-1)


def _logprobs_hf(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprobs_and_greedy_match_transformers(case, tmp_path, make_hf):
    spec = dict(CASES[case])
    save_kwargs = spec.pop("save", {})
    ref = make_hf(spec.pop("arch"), **spec)
    out = tmp_path / case
    ref.save_pretrained(out, **save_kwargs)
    if save_kwargs:
        assert (out / "model.safetensors.index.json").is_file()
        assert len(list(out.glob("model-*.safetensors"))) > 1
    ours = load_model(out)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == bool(spec.get("tie"))

    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    diff = (_logprobs_ours(ours, ids) - _logprobs_hf(ref, ids)).abs().max().item()
    assert diff <= 1e-4, f"max |logprob diff| {diff}"

    prompt = ids[:7]
    with torch.no_grad():
        hf_out = ref.generate(prompt[None], max_new_tokens=10, do_sample=False,
                              attention_mask=torch.ones(1, 7, dtype=torch.long))[0, 7:].tolist()
    assert greedy_generate(ours, prompt.tolist(), 10, eos_token_ids=[1, 2]) == hf_out


def test_moe_checkpoint_stores_experts_per_expert(hf_moe_dir):
    from safetensors import safe_open

    with safe_open(hf_moe_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    model = load_model(hf_moe_dir)
    packed = model.model.layers[0].mlp.experts.up_proj.weight          # [E, out, in]
    with safe_open(hf_moe_dir / "model.safetensors", framework="pt") as f:
        assert torch.equal(packed[3], f.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_is_close(hf_dense_dir, dtype):
    ours32 = load_model(hf_dense_dir)
    ours = load_model(hf_dense_dir, dtype=dtype)
    assert all(p.dtype == dtype for p in ours.parameters())
    ids = torch.arange(20) % VOCAB
    full, half = _logprobs_ours(ours32, ids), _logprobs_ours(ours, ids)
    assert half.dtype == torch.float32
    assert (full.argmax(-1) == half.argmax(-1)).float().mean() >= 0.9
    assert (full - half).abs().max() < 0.5
