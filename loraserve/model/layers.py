"""The parts every supported decoder shares, in plain torch over a flattened batch of tokens.

Module paths mirror transformers (`self_attn.q_proj`, `mlp.up_proj`), so a LoRA layer replaces a
target with `setattr` and no model file changes. What differs by architecture (q/k norm, biases,
sliding window) comes from `ModelConfig` and its `Arch` row, never from a subclass.
Letters: T tokens, H hidden, D head dim, Hq / Hkv query / key-value heads.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loraserve.model.config import ModelConfig
from loraserve.model.rope import Device, apply_rotary


class AttentionFn(Protocol):
    """attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D].

    q and k arrive after q_norm/k_norm and RoPE. The engine's implementation writes k/v into its
    paged cache and attends over each sequence's history. Layers with a sliding window (Mistral,
    Qwen2's upper layers) also pass `window=W`: a query at position p then sees keys p-W+1..p only.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, *,
                 window: int | None = None) -> Tensor: ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Softmax(q k^T / sqrt(D)) v over one causal sequence, GQA by head groups; with `window`,
    each query sees only the last `window` positions (its own included).

    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] (softmax in float32, like transformers' eager path).
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    t = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5       # [Hq, T, T]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        mask = mask.triu(1 - window)                                       # keys > query - window
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 and cast back before the scale."""

    def __init__(self, dim: int, eps: float, device: Device = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))  # [dim]
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention: q/k/v projections (bias per architecture), per-head RMSNorm on q and k
    (Qwen3), RoPE, causal attention (within a sliding window where the layer has one), o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: Device = None):
        super().__init__()
        self.layer_idx, self.window = layer_idx, cfg.layer_window(layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d, qkv_bias = cfg.hidden_size, cfg.head_dim, cfg.qkv_bias
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=qkv_bias, device=device)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=qkv_bias, device=device)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=qkv_bias, device=device)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias, device=device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, device)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None) -> Tensor:
        """x [T, H] -> [T, H]."""
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))     # [T, Hq, D]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)               # [T, Hkv, D]
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if attn is None:
            out = causal_attention(q, k, v, self.window)
        elif self.window is None:  # full-context layers call attn as every AttentionFn accepts
            out = attn(self.layer_idx, q, k, v)
        else:
            out = attn(self.layer_idx, q, k, v, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, device: Device = None, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
