"""Qwen3 and Qwen3-MoE in plain torch, over a flattened batch of tokens.

The model never sees sequences: `forward(input_ids [T], positions [T], attn)` runs T tokens from any
number of sequences, and the `attn` callable (the engine's paged attention) decides which tokens
attend to which. With `attn=None` the T tokens are one causal sequence (tests, training).

Module paths mirror transformers (`model.layers[l].self_attn.q_proj`, `...mlp.experts.up_proj`), so
a LoRA layer replaces a target with `setattr` and the model file never changes. MoE experts live in
packed `ExpertLinear` weights `[E, out, in]`; the block calls them only through
`ExpertLinear.forward(x, expert_ids, token_index)`.
Letters: T tokens, H hidden, V vocab, E experts, K top-k, P = T*K (token, expert) pairs, D head dim.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loraserve.model.config import ModelConfig

Device = torch.device | str | None


class AttentionFn(Protocol):
    """attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D].

    q and k arrive after q_norm/k_norm and RoPE. The engine's implementation writes k/v into its
    paged cache and attends over each sequence's history."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Softmax(q k^T / sqrt(D)) v over one causal sequence, GQA by head groups.

    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] (softmax in float32, like transformers' eager path).
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    t = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5       # [Hq, T, T]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
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


class RotaryEmbedding(nn.Module):
    """Standard (non-interleaved, rotate-half) RoPE with inverse frequencies theta^(-2i/D)."""

    def __init__(self, head_dim: int, theta: float, device: Device = None):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)  # [D/2] fp32

    def _inv_freq(self, device: Device) -> Tensor:
        # computed on CPU: meta-device arange is slow on first use and the values are tiny
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return (1.0 / (self.theta ** exps)).to(device)

    def reset_buffers(self, device: Device) -> None:
        """Recompute inv_freq on `device` (after building the model on the meta device)."""
        self.inv_freq = self._inv_freq(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D] in `dtype`, broadcastable over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]        # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D] rotated: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention with per-head RMSNorm on q and k (Qwen3), then RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: Device = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False, device=device)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False, device=device)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False, device=device)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False, device=device)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, device)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, device)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None) -> Tensor:
        """x [T, H] -> [T, H]."""
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))     # [T, Hq, D]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)               # [T, Hkv, D]
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = causal_attention(q, k, v) if attn is None else attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, device: Device = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        unsorted = (expert_ids[1:] < expert_ids[:-1]).any().to(counts.dtype)
        *counts, unsorted = torch.cat([counts, unsorted[None]]).tolist()   # one device sync
        if unsorted or len(counts) != self.num_experts:
            raise ValueError("ExpertLinear rows must be grouped by expert id in ascending order, "
                             f"with ids in [0, {self.num_experts})")
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = x[start:start + n] @ self.weight[e].T
                start += n
        return out

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


class DecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: Device = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, device)
        self.mlp = SparseMoeBlock(cfg, device) if cfg.is_moe_layer(layer_idx) \
            else MLP(cfg.hidden_size, cfg.intermediate_size, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, device: Device = None):
        super().__init__()
        # _weight skips nn.Embedding's normal_ init (slow on the meta device, overwritten anyway)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, device=device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, l, device) for l in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn | None) -> Tensor:
        """input_ids [T], positions [T] -> hidden [T, H] after the final norm."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    """Decoder plus unembedding; `lm_head.weight` is `embed_tokens.weight` when tied.

    Construction does not initialise weights meaningfully (embedding and experts are left
    uninitialised): load a checkpoint, or draw weights as `model.tiny.random_model` does.
    `device="meta"` builds the skeleton the loader assigns into."""

    def __init__(self, config: ModelConfig, *, device: Device = None):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head share the embedding Parameter (a no-op for untied configs)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn | None = None) -> Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H] (final norm applied)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"expected input_ids [T] and positions [T], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, H] -> logits [M, V] float32, through self.lm_head (LoRA-wrappable)."""
        return self.lm_head(hidden).float()
