"""A decode step's decoder layers as a flat list of calls: the CPU serving fast path.

At a few tokens a step, a small model's step outside its GEMVs is Python: every layer's module
calls (`Module.__call__` for the layer's attention, MLP and projections, twice for a LoRA wrapper
and its base), `_project`'s checks of each fused projection, the attention function's own checks,
and the dispatch of ~11 ops. SmolLM2-135M on the 2-core dev machine, Q4_1: ~2 ms of a 10 ms step.
A `DecodePlan` resolves all of that once: for each layer, the bound forward of its fused q/k/v,
o, gate/up and down GEMMs (the quantized kernel called directly where it applies), the norms'
weights, the head counts; a step then runs per layer

    x, h = add_rms_norm(x, o(attend(qkv(h))), post_norm)
    x, h = add_rms_norm(x, down(silu_mul_halves(gate_up(h))), next_norm)

with `attend` the attention function's per-step closure (`AttentionFn.qkv_decoder`): the same ops
in the same order as `DecoderModel._forward_fused`'s decode path, so the same numbers.

It applies only where that path would call nothing else: every layer a dense MLP with fused
gate/up and an attention with fused q/k/v, every projection a plain slice or a plain GEMM, or a
wrapper (a serving LoRA layer) `idle` this step over one; no hook on any module of the layers,
and no global module hook. Anything else (an adapter's token in the batch, a training hook, MoE
layers) runs the module path. A plan is rebuilt when any module, parameter or buffer is registered
anywhere after it was built (torch's global registration hooks count them), so a wrapper installed
or a weight replaced later is never bypassed.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from loraserve.kernels import cpu_fused, cpu_quant
from loraserve.model.layers import FusedSlice
from loraserve.model.quant import QuantLinear

_registrations = [0]  # modules, parameters and buffers registered in this process so far


def _count(*_args) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """Modules, parameters and buffers registered in this process so far (a plan built at one
    count holds until the next)."""
    return _registrations[0]


_module.register_module_module_registration_hook(_count)
_module.register_module_parameter_registration_hook(_count)
_module.register_module_buffer_registration_hook(_count)

_GLOBAL_HOOKS = tuple(getattr(_module, name) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks") if hasattr(_module, name))


def _plain(p: nn.Module, wrappers: list[nn.Module]) -> nn.Module | None:
    """p itself, or the base of a wrapper with an `idle` property (recorded in `wrappers`)."""
    if getattr(type(p), "idle", None) is not None:
        wrappers.append(p)
        p = getattr(p, "base", None)
    return p


def _gemm(p: nn.Module | None, dtype: torch.dtype) -> tuple[Callable[[Tensor], Tensor], int] | None:
    """(x -> p(x) without nn.Module's call, the most rows it serves so) for a plain GEMM module."""
    if p is None or list(p.children()):
        return None
    if type(p) is QuantLinear and p.native and p.bias is None and dtype == torch.float32:
        codes, scales, mins, bits, group = p.codes, p.scales, p.mins, p.bits, p.group
        return (lambda x: cpu_quant.quant_linear(x, codes, scales, mins, bits, group)), p.max_rows
    if not hasattr(p, "in_features"):
        return None
    return p.forward, 1 << 30


class DecodePlan:
    """The layers of one `DecoderModel` as per-layer call tuples (module doc). `build` returns
    None where the plan does not apply to the model as it stands."""

    def __init__(self, layers: list[tuple], first: tuple[Tensor, float], wrappers: list[nn.Module],
                 hook_dicts: list[dict], max_rows: int, dtype: torch.dtype):
        self.layers, self.first, self.max_rows, self.dtype = layers, first, max_rows, dtype
        # one wrapper per shared state: wrappers over one LoRA state are idle together
        self.idles = list({id(getattr(w, "state", w)): w for w in wrappers}.values())
        self.hook_dicts = hook_dicts

    @classmethod
    def build(cls, model: nn.Module) -> DecodePlan | None:
        """For a `DecoderModel` (its `layers`, `norm`); None unless every layer fits (module doc)."""
        layers, wrappers, max_rows = [], [], 1 << 30
        dtype = model.norm.weight.dtype
        hook_dicts = [d for m in model.layers.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if getattr(attn, "qkv_proj", None) is None or getattr(mlp, "gate_up_proj", None) is None:
                return None
            slices = [_plain(p, wrappers) for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj,
                                                      mlp.up_proj)]
            if any(type(p) is not FusedSlice for p in slices):
                return None
            gemms = [_gemm(_plain(p, wrappers), dtype)
                     for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(g is None for g in gemms):
                return None
            max_rows = min([max_rows, *(rows for _, rows in gemms)])
            (qkv, _), (o, _), (gate_up, _), (down, _) = gemms
            after = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
            post = layer.post_attention_layernorm
            norm_w = attn.qk_norm_weight
            if any(w is not None and w.dtype != dtype for w in (norm_w, post.weight, after.weight)):
                return None
            layers.append((i, qkv, o, gate_up, down, attn.num_heads, attn.num_kv_heads, norm_w,
                           attn.q_norm.eps if norm_w is not None else 0.0, attn.window or 0,
                           post.weight, post.eps, after.weight, after.eps))
        first = model.layers[0].input_layernorm
        return cls(layers, (first.weight, first.eps), wrappers, hook_dicts, max_rows, dtype)

    def applies(self, x: Tensor) -> bool:
        """This step may run the plan: x's rows and dtype, no hook anywhere, every wrapper idle."""
        return (x.dtype == self.dtype and x.shape[0] <= self.max_rows and not any(self.hook_dicts)
                and not any(_GLOBAL_HOOKS) and all(w.idle for w in self.idles))

    def run(self, x: Tensor, attend: Callable) -> Tensor:
        """x [T, H] (the embeddings) -> hidden [T, H] after the final norm; `attend(layer, qkv,
        heads, kv_heads, norm_w, eps, window)` is the step's `AttentionFn.qkv_decoder`."""
        add_rms_norm, silu_mul_halves = cpu_fused.add_rms_norm, cpu_fused.silu_mul_halves
        h = cpu_fused.rms_norm(x, *self.first)
        for (i, qkv, o, gate_up, down, heads, kv_heads, norm_w, eps, window,
             post_w, post_eps, after_w, after_eps) in self.layers:
            x, h = add_rms_norm(x, o(attend(i, qkv(h), heads, kv_heads, norm_w, eps, window)), post_w, post_eps)
            x, h = add_rms_norm(x, down(silu_mul_halves(gate_up(h))), after_w, after_eps)
        return h
