"""Routed experts (Qwen3-MoE): packed expert weights and the top-k sparse MoE block.

Experts live in packed `ExpertLinear` weights `[E, out, in]`; the block calls them only through
`ExpertLinear.forward(x, expert_ids, token_index)`, so a LoRA wrapper can replace one by `setattr`.
Letters: T tokens, H hidden, E experts, K top-k, P = T*K (token, expert) pairs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loraserve.model.config import ModelConfig
from loraserve.model.rope import Device


class ExpertLinear(nn.Module):
    """y[i] = x[i] @ weight[expert_ids[i]]^T, one row per (token, expert) pair.

    weight [E, out, in]. Rows must be grouped by expert in ascending order (the MoE block sorts
    its pairs once per layer); the op runs one matmul per expert that has rows.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, device: Device = None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, device=device))

    def forward(self, x: Tensor, expert_ids: Tensor, token_index: Tensor) -> Tensor:
        """x [P, in], expert_ids [P] int64 sorted, token_index [P] int64 -> [P, out].

        token_index (each pair's token row in the batch) is unused here; a LoRA wrapper that
        replaces this module uses it to find each pair's adapter."""
        out = x.new_empty(x.shape[0], self.out_features)
        start = 0
        for e, n in enumerate(self._counts(expert_ids)):
            if n:
                out[start:start + n] = x[start:start + n] @ self.weight[e].T
                start += n
        return out

    def _counts(self, expert_ids: Tensor) -> list[int]:
        """Rows per expert, in expert order; ValueError unless the rows are grouped by expert
        in ascending order with ids in range."""
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        unsorted = (expert_ids[1:] < expert_ids[:-1]).any().to(counts.dtype)
        *counts, unsorted = torch.cat([counts, unsorted[None]]).tolist()   # one device sync
        if unsorted or len(counts) != self.num_experts:
            raise ValueError("ExpertLinear rows must be grouped by expert id in ascending order, "
                             f"with ids in [0, {self.num_experts})")
        return counts

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}"


class Experts(nn.Module):
    """The E SwiGLU experts of one MoE layer, packed per projection."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device: Device = None):
        super().__init__()
        self.gate_proj = ExpertLinear(num_experts, hidden, intermediate, device)
        self.up_proj = ExpertLinear(num_experts, hidden, intermediate, device)
        self.down_proj = ExpertLinear(num_experts, intermediate, hidden, device)

    def forward(self, x: Tensor, expert_ids: Tensor, token_index: Tensor) -> Tensor:
        """x [P, H] grouped by expert -> [P, H] (unweighted expert outputs)."""
        h = F.silu(self.gate_proj(x, expert_ids, token_index)) * self.up_proj(x, expert_ids, token_index)
        return self.down_proj(h, expert_ids, token_index)


class SparseMoeBlock(nn.Module):
    """y[t] = sum over the top-k experts e of t: w[t, e] * expert_e(x[t]).

    Router logits -> float32 softmax -> top-k -> renormalised when norm_topk_prob (transformers'
    Qwen3MoeSparseMoeBlock numerics)."""

    def __init__(self, cfg: ModelConfig, device: Device = None):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, device=device)  # router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, device)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, K] in x.dtype, expert ids [T, K] int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)    # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: Tensor) -> Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = self.route(x)
        flat_ids = ids.reshape(-1)                                          # [P]
        order = torch.argsort(flat_ids, stable=True)                        # pairs grouped by expert
        expert_ids = flat_ids[order]
        token_index = order // self.top_k                                   # [P] token row of pair
        out = self.experts(x[token_index], expert_ids, token_index)         # [P, H]
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_index, out)
