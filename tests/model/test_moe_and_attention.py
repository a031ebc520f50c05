"""MoE block and ExpertLinear against naive loops; the AttentionFn hook and LoRA-wrappable paths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.model import CausalLM, ExpertLinear, causal_attention
from loraserve.model.moe import SparseMoeBlock
from loraserve.model.tiny import random_model, tiny_config

SMALL_MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, num_experts=5, num_experts_per_tok=2,
                 moe_intermediate_size=16, eos_token_ids=[1])


def test_expert_linear_matches_per_row_loop():
    gen = torch.Generator().manual_seed(0)
    lin = ExpertLinear(4, 6, 3)
    nn.init.normal_(lin.weight, generator=gen)
    ids = torch.tensor([0, 0, 2, 2, 2, 3])                    # expert 1 has no rows
    x = torch.randn(6, 6, generator=gen)
    out = lin(x, ids, torch.arange(6))
    ref = torch.stack([lin.weight[e] @ x[i] for i, e in enumerate(ids.tolist())])
    torch.testing.assert_close(out, ref)
    assert lin(x[:0], ids[:0], ids[:0]).shape == (0, 3)
    with pytest.raises(ValueError, match="grouped by expert"):
        lin(x, ids.flip(0), torch.arange(6))
    with pytest.raises(ValueError, match="grouped by expert"):
        lin(x, torch.tensor([0, 0, 1, 1, 2, 4]), torch.arange(6))


def _moe_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, one expert at a time: the definition of the block."""
    out = torch.zeros_like(x)
    ex = block.experts
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate(x[t]).float(), -1)
        w, ids = probs.topk(block.top_k)
        if block.norm_topk_prob:
            w = w / w.sum()
        for wi, e in zip(w.tolist(), ids.tolist()):
            h = F.silu(ex.gate_proj.weight[e] @ x[t]) * (ex.up_proj.weight[e] @ x[t])
            out[t] += wi * (ex.down_proj.weight[e] @ h)
    return out


def test_moe_block_matches_token_loop():
    for norm in (True, False):
        model = random_model(tiny_config("qwen3_moe", norm_topk_prob=norm, **SMALL_MOE), seed=1)
        block = model.model.layers[0].mlp
        x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(block(x), _moe_reference(block, x), rtol=1e-5, atol=1e-5)


class _SpyExperts(nn.Module):
    """Stands in for a LoRA wrapper: records what the block passes, adds nothing."""

    def __init__(self, base: ExpertLinear, calls: list):
        super().__init__()
        self.base, self.calls = base, calls

    def forward(self, x, expert_ids, token_index):
        self.calls.append((x.shape, expert_ids.clone(), token_index.clone()))
        return self.base(x, expert_ids, token_index)


def test_expert_linear_can_be_replaced_by_setattr():
    model = random_model(tiny_config("qwen3_moe", **SMALL_MOE), seed=1)
    ids = torch.arange(7) % 64
    with torch.no_grad():
        before = model(ids, torch.arange(7))
        calls: list = []
        experts = model.model.layers[1].mlp.experts
        experts.up_proj = _SpyExperts(experts.up_proj, calls)
        after = model(ids, torch.arange(7))
    torch.testing.assert_close(before, after)
    (shape, expert_ids, token_index), = calls
    assert shape == (7 * 2, 32)
    assert torch.all(expert_ids[1:] >= expert_ids[:-1])                      # grouped by expert
    assert sorted(token_index.tolist()) == sorted(list(range(7)) * 2)        # each token top_k times


def test_every_lora_target_is_a_named_module():
    model = random_model(tiny_config("qwen3_moe", mlp_only_layers=[0], **SMALL_MOE), seed=0)
    names = dict(model.named_modules())
    for kind in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(names[f"model.layers.1.self_attn.{kind}"], nn.Linear)
    for kind in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(names[f"model.layers.0.mlp.{kind}"], nn.Linear)
        assert isinstance(names[f"model.layers.1.mlp.experts.{kind}"], ExpertLinear)
    assert isinstance(names["model.layers.1.mlp.gate"], nn.Linear)
    assert isinstance(names["lm_head"], nn.Linear)


def _varlen_attention(seq_lens: list[int], seen: list):
    """An AttentionFn that treats the flat batch as independent causal sequences."""

    def attn(layer_idx, q, k, v):
        seen.append((layer_idx, q.shape, k.shape, v.shape))
        outs, start = [], 0
        for n in seq_lens:
            outs.append(causal_attention(q[start:start + n], k[start:start + n], v[start:start + n]))
            start += n
        return torch.cat(outs)

    return attn


def test_flattened_batch_with_attention_fn_equals_separate_runs():
    model: CausalLM = random_model(tiny_config("qwen3", **{k: v for k, v in SMALL_MOE.items()
                                                                  if "expert" not in k}), seed=3)
    a, b = torch.tensor([5, 9, 2, 7]), torch.tensor([3, 1, 4, 1, 5, 9])
    seen: list = []
    with torch.no_grad():
        both = model(torch.cat([a, b]), torch.cat([torch.arange(4), torch.arange(6)]),
                     _varlen_attention([4, 6], seen))
        ha, hb = model(a, torch.arange(4)), model(b, torch.arange(6))
    torch.testing.assert_close(both, torch.cat([ha, hb]), rtol=1e-5, atol=1e-5)
    assert [s[0] for s in seen] == [0, 1]
    assert seen[0][1:] == ((10, 4, 8), (10, 2, 8), (10, 2, 8))
    assert model.compute_logits(both).dtype == torch.float32


def test_forward_rejects_batched_shapes():
    model = random_model(tiny_config("qwen3", **{k: v for k, v in SMALL_MOE.items() if "expert" not in k}))
    with pytest.raises(ValueError, match=r"input_ids \[T\]"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
