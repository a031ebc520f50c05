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

from loraserve.kernels.tracing import compiling
from loraserve.kernels import cpu_fused
from loraserve.model.config import ModelConfig
from loraserve.model.quant import QuantLinear
from loraserve.model.quant import fusable as quant_fusable
from loraserve.model.rope import Device, apply_rotary


class AttentionFn(Protocol):
    """attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D].

    q and k arrive after q_norm/k_norm and RoPE. The engine's implementation writes k/v into its
    paged cache and attends over each sequence's history. Layers with a sliding window (Mistral,
    Qwen2's upper layers) also pass `window=W`: a query at position p then sees keys p-W+1..p only.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, *,
                 window: int | None = None) -> Tensor: ...

    # Optional (the engine's PagedAttention has it): fused_qkv(layer_idx, qkv, heads, kv_heads,
    # rope, norm_w, eps, window) -> [T, Hq * D] or None. The same arithmetic from a fused q/k/v
    # output [T, (Hq + 2 Hkv) D] before norm and rotary (norm_w [Hq + Hkv, D] or None), in one
    # call; None where it does not apply this step (the model then slices and calls as above).
    # Optional too: qkv_decoder(x, rope) -> attend(layer_idx, qkv, heads, kv_heads, norm_w, eps,
    # window) or None: fused_qkv for a whole step, decided once (`model.decode_plan`).


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


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, normalised in float32 and cast back
    before the scale. A float32 x skips the two casts: at one token a norm is ~5 us kernels, and
    a 0.6B-shaped decode step runs 113 of them (each cast is a dispatch, even when a no-op).
    Serving on the CPU (no autograd, eager) runs it as one fused op (kernels.cpu_fused)."""
    if x.dim() in (2, 3) and weight.dtype == x.dtype and cpu_fused.usable(x):
        return cpu_fused.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) (`rms_norm`)."""

    def __init__(self, dim: int, eps: float, device: Device = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))  # [dim]
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


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
        self.qkv_proj: nn.Module | None = None  # q/k/v in one GEMM once `fuse` ran
        # [Hq + Hkv, D]: q_norm's and k_norm's weights per head, once `fuse` ran (Qwen3)
        self.register_buffer("qk_norm_weight", None, persistent=False)

    def fuse(self) -> bool:
        """Put q/k/v's weights into one `qkv_proj` (a GEMM instead of three); False if done or
        not plain linears. q_norm's and k_norm's weights are stacked per head too, so the q and k
        columns of the fused output are normalised and rotated as one tensor (`_qk_together`)."""
        fused = fuse_linears(self, ("q_proj", "k_proj", "v_proj"))
        if fused is None:
            return False
        self.qkv_proj = fused
        if isinstance(self.q_norm, RMSNorm):
            d = self.head_dim
            w = torch.cat([self.q_norm.weight.detach().expand(self.num_heads, d),
                           self.k_norm.weight.detach().expand(self.num_kv_heads, d)])
            self.qk_norm_weight = w
        return True

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None) -> Tensor:
        """x [T, H] -> [T, H]."""
        t = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            qkv = self.qkv_proj(x)
            projections = (self.q_proj, self.k_proj, self.v_proj)
            fused = getattr(attn, "fused_qkv", None)
            if fused is not None and cpu_fused.usable(qkv):
                # one op from qkv (`AttentionFn.fused_qkv`) once any LoRA wrapper added its delta there
                kv = self.num_kv_heads * self.head_dim
                widths = (self.num_heads * self.head_dim, kv, kv)
                q, k, v = _project(x, qkv, projections, widths)
                if q is None and k is None and v is None:
                    eps = self.q_norm.eps if self.qk_norm_weight is not None else 0.0
                    out = fused(self.layer_idx, qkv, self.num_heads, self.num_kv_heads, rope, self.qk_norm_weight,
                                eps, self.window)
                    if out is not None:
                        return call_projection(self.o_proj, out)
                q, k, v = _columns(qkv, (q, k, v), widths)
            else:
                q, k, v = (p(x, qkv) for p in projections)
        v = v.view(t, self.num_kv_heads, self.head_dim)                # [T, Hkv, D]
        if self.qkv_proj is not None and _in_place(q, k, qkv):
            q, k = self._qk_together(qkv, rope)
        else:
            q = self._rotate(q.view(t, self.num_heads, self.head_dim), self.q_norm, rope)     # [T, Hq, D]
            k = self._rotate(k.view(t, self.num_kv_heads, self.head_dim), self.k_norm, rope)  # [T, Hkv, D]
        if attn is None:
            out = causal_attention(q, k, v, self.window)
        elif self.window is None:  # full-context layers call attn as every AttentionFn accepts
            out = attn(self.layer_idx, q, k, v)
        else:
            out = attn(self.layer_idx, q, k, v, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    @staticmethod
    def _rotate(x: Tensor, norm: nn.Module, rope: tuple[Tensor, Tensor]) -> Tensor:
        """x [T, heads, D] normalised (Qwen3's q/k norm; an Identity elsewhere) and rotated:
        one fused op when serving on the CPU, the same arithmetic `_qk_together` does there."""
        w = norm.weight if isinstance(norm, RMSNorm) else None
        if cpu_fused.usable(x) and rope[0].dtype == x.dtype and (w is None or w.dtype == x.dtype):
            return cpu_fused.rope(x, rope[0], rope[1], w, norm.eps if w is not None else 0.0)
        return apply_rotary(norm(x), *rope)

    def _qk_together(self, qkv: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] from the fused output's q and k columns, normalised
        (`qk_norm_weight`) and rotated as one [T, Hq + Hkv, D] tensor: the same per-head
        arithmetic as apart, in half the kernels (a decode step at one token pays per kernel, not
        per byte: 28 layers x 6 fewer at 0.6B shapes)."""
        t, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk = qkv[:, :heads * self.head_dim].view(t, heads, self.head_dim)
        if cpu_fused.usable(qk) and rope[0].dtype == qk.dtype and (
                self.qk_norm_weight is None or self.qk_norm_weight.dtype == qk.dtype):
            # serving on the CPU: norm and rotation of every q/k head in one op (kernels.cpu_fused)
            eps = self.q_norm.eps if self.qk_norm_weight is not None else 0.0
            qk = cpu_fused.rope(qk, rope[0], rope[1], self.qk_norm_weight, eps)
            return qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.q_norm.eps)
        qk = apply_rotary(qk, *rope)
        return qk[:, :self.num_heads], qk[:, self.num_heads:]


def _project(x: Tensor, fused: Tensor, projections: tuple[nn.Module, ...],
             widths: tuple[int, ...]) -> list[Tensor | None]:
    """Each projection's columns (`widths`, in order) of a fused GEMM's output, for a caller that
    reads `fused` as a whole: None for a plain `FusedSlice` (not called: its columns are in `fused`
    as they are), for a wrapper that is `idle` this step over one (not called either), and for a
    wrapper that returned its columns in place (a serving LoRA wrapper,
    whose delta is now in `fused`); the tensor it returned otherwise (a hook's slice + delta),
    which the caller must use instead of `fused`'s columns (`_columns`). Each projection that is
    not a plain slice is called exactly once: the caller must not call it again."""
    out: list[Tensor | None] = []
    base, size, lo = fused.data_ptr(), fused.element_size(), 0
    for p, width in zip(projections, widths):
        p = idle_base(p)  # a wrapper with nothing to add this step (a serving LoRA wrapper, no LoRA token)
        if type(p) is FusedSlice and not (p._forward_hooks or p._forward_pre_hooks):
            out.append(None)
        else:
            y = p(x, fused)
            same = (y.data_ptr() == base + lo * size and tuple(y.shape) == (fused.shape[0], width)
                    and y.stride() == fused.stride())
            out.append(None if same else y)
        lo += width
    return out


def idle_base(p: nn.Module) -> nn.Module:
    """p.base when p is a wrapper (a class with an `idle` property: the serving LoRA wrapper) that
    is idle this step and has no hook of its own, else p: calling the base is then the same as
    calling p, one module call fewer. The class is asked first, so a plain module never falls into
    nn.Module's slow attribute lookup."""
    if getattr(type(p), "idle", None) is not None and p.idle and not (p._forward_hooks or p._forward_pre_hooks):
        return p.base
    return p


def call_projection(p: nn.Module, x: Tensor) -> Tensor:
    """p(x) through `idle_base`: the decode step's o and down projections cost one module call
    each on a server with a catalog, as without one."""
    return idle_base(p)(x)


def _columns(fused: Tensor, outs: list[Tensor | None], widths: tuple[int, ...]) -> list[Tensor]:
    """`_project`'s results made whole: its None entries become their columns of `fused` (a
    view; the projection is not called again, so a delta it added in place is not added twice)."""
    cols, lo = [], 0
    for y, width in zip(outs, widths):
        cols.append(fused[:, lo:lo + width] if y is None else y)
        lo += width
    return cols


def _in_place(q: Tensor, k: Tensor, fused: Tensor) -> bool:
    """Whether q and k are still the fused q/k/v output's first columns (addresses, since
    inference mode records no view bases), so that whatever changed them (a serving LoRA wrapper
    adds its delta in place) is in `fused`. A training hook returns a new tensor (slice + delta);
    a compiled graph takes the separate path (inductor fuses those kernels itself)."""
    if compiling():
        return False
    base = fused.data_ptr()
    return q.data_ptr() == base and k.data_ptr() == base + q.shape[-1] * fused.element_size()


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, device: Device = None, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, device=device)
        self.gate_up_proj: nn.Module | None = None  # gate/up in one GEMM once `fuse` ran

    def fuse(self) -> bool:
        """Put gate/up's weights into one `gate_up_proj`; False if done or not plain linears."""
        fused = fuse_linears(self, ("gate_proj", "up_proj"))
        if fused is not None:
            self.gate_up_proj = fused
        return fused is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        both = self.gate_up_proj(x)
        if both.dim() == 2 and cpu_fused.usable(both):
            half = both.shape[1] // 2
            gate, up = _project(x, both, (self.gate_proj, self.up_proj), (half, half))
            if gate is None and up is None:
                return call_projection(self.down_proj, cpu_fused.silu_mul_halves(both))  # the halves read in place, one op
            gate, up = _columns(both, (gate, up), (half, half))
        else:
            gate, up = self.gate_proj(x, both), self.up_proj(x, both)
        if gate.dim() == 2 and gate.dtype == up.dtype and cpu_fused.usable(gate):
            return call_projection(self.down_proj, cpu_fused.silu_mul(gate, up))  # one op (kernels.cpu_fused)
        return self.down_proj(F.silu(gate) * up)


class FusedSlice(nn.Module):
    """One projection's columns of a fused GEMM's output (q of `qkv_proj`, gate of `gate_up_proj`).

    It stays at the projection's own module path (`self_attn.q_proj`), so whatever finds a
    projection by path finds it there: the serving LoRA wrapper, which then adds its adapters'
    delta to these columns in place; the training hooks, which return slice + delta; the adapter
    pool's shapes (`in_features`, `out_features`). The parent runs the one GEMM and hands its
    output in: forward(x [T, in], fused [T, sum of outs]) -> fused[:, lo:lo + out], a view."""

    def __init__(self, in_features: int, out_features: int, lo: int):
        super().__init__()
        self.in_features, self.out_features, self.lo = in_features, out_features, lo

    def forward(self, x: Tensor, fused: Tensor) -> Tensor:  # noqa: ARG002 (x: for LoRA and hooks)
        return fused[..., self.lo:self.lo + self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns from {self.lo}"


@torch.no_grad()
def fuse_linears(owner: nn.Module, names: tuple[str, ...]) -> nn.Linear | None:
    """One `nn.Linear` holding the weights (and biases) of `owner`'s plain linears `names`,
    concatenated along the output axis (or one `QuantLinear` of quantized ones, model.quant);
    each of `names` becomes its `FusedSlice`. None (and nothing changed) unless every one is a
    plain `nn.Linear` (or every one a QuantLinear of one scheme) on one input: already fused,
    wrapped by LoRA or packed, the owner keeps its separate GEMMs."""
    parts = [getattr(owner, n) for n in names]
    if quant_fusable(parts):  # a quantized base's: codes, scales and mins stacked the same way
        fused = QuantLinear.cat(parts)
    elif not all(type(p) is nn.Linear for p in parts) or len({p.in_features for p in parts}) != 1:
        return None
    else:
        fused = _stacked(parts)
    lo = 0
    for name, p in zip(names, parts):
        setattr(owner, name, FusedSlice(p.in_features, p.out_features, lo))
        lo += p.out_features
    return fused


def _stacked(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear of `parts`' weights (and biases) along the output axis."""
    w = torch.cat([p.weight for p in parts])                                   # [sum out, in]
    fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if any(p.bias is not None for p in parts):
        fused.bias = nn.Parameter(torch.cat([p.bias if p.bias is not None else w.new_zeros(p.out_features)
                                             for p in parts]), requires_grad=False)
    return fused
