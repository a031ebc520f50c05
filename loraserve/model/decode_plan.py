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
in the same order as `DecoderModel._forward_fused`'s decode path, so the same numbers. Where every
projection is one whose op the plan knows (`_native`: a `VectorLinear` on `cpu_gemv`, a native
`QuantLinear`, an `nn.Linear`) and the closure carries the step's attention arguments
(`step_args`), the loop itself runs in C++ (`cpu_fused.decode_layers`: the same calls, bit-equal;
`NATIVE_LOOP` False keeps it in Python for a comparison).

It applies only where that path would call nothing else: every layer a dense MLP with fused
gate/up and an attention with fused q/k/v, every projection a plain slice or a plain GEMM, or a
wrapper (a serving LoRA layer) over one that is `idle` this step (`run`) or whose delta this
step is one `lora_addmm_` of known rank rows (`one_rows`: the steady decode of one adapter;
`run` then adds each where the wrapper would, in the same order); no hook on any module of the
layers, and no global module hook. Anything else (a mixed batch, a training hook, MoE layers)
runs the module path. A plan is rebuilt when any module, parameter or buffer is registered
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

GLOBAL_HOOKS = tuple(getattr(_module, name) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks") if hasattr(_module, name))


def _unwrap(p: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(the wrapper, its base) for a wrapper (a class with an `idle` property, as
    `model.layers.idle_base` tells them), else (None, p)."""
    if getattr(type(p), "idle", None) is not None:
        return p, getattr(p, "base", None)
    return None, p


def _native(p: nn.Module, dtype: torch.dtype) -> tuple[tuple[int, int, int], list[Tensor]] | None:
    """((kind, bits, group), tensors) of a projection `cpu_fused.decode_layers` calls itself, the
    op its own forward calls: kind 0 a `VectorLinear` on `cpu_gemv`'s kernel (weight, bias), 1 a
    native `QuantLinear` (codes, scales, mins), 2 an `nn.Linear` (weight, bias: `F.linear`); an
    absent bias is an empty tensor. None for any other module."""
    from loraserve.model.prepack import VectorLinear
    none = torch.empty(0, dtype=dtype)
    if type(p) is VectorLinear and p.native and p.weight.dtype == dtype:
        return (0, 0, 0), [p.weight, p.bias if p.bias is not None else none]
    if type(p) is QuantLinear and p.native and p.bias is None and dtype == torch.float32:
        return (1, p.bits, p.group), [p.codes, p.scales, p.mins]
    if type(p) is nn.Linear and p.weight.dtype == dtype:
        return (2, 0, 0), [p.weight, p.bias if p.bias is not None else none]
    return None


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

    def __init__(self, layers: list[tuple], deltas: list[tuple], first: tuple[Tensor, float],
                 wrappers: list[nn.Module], hook_dicts: list[dict], max_rows: int, dtype: torch.dtype,
                 native: tuple | None = None):
        self.layers, self.deltas, self.first, self.max_rows, self.dtype = layers, deltas, first, max_rows, dtype
        # (weights, proj, norms, meta, eps) for `cpu_fused.decode_layers` where every projection
        # is one it calls itself (`_native`), else None: the loop runs in Python
        self.native = native
        self.wrappers = wrappers
        # one wrapper per shared state: wrappers over one LoRA state are idle together
        self.idles = list({id(getattr(w, "state", w)): w for w in wrappers}.values())
        self.hook_dicts = hook_dicts

    @classmethod
    def build(cls, model: nn.Module) -> DecodePlan | None:
        """For a `DecoderModel` (its `layers`, `norm`); None unless every layer fits (module doc)."""
        layers, deltas, wrappers, max_rows = [], [], [], 1 << 30
        dtype = model.norm.weight.dtype
        weights, proj, norms, meta, eps = [], [], [], [], []  # decode_layers' lists (`native`)
        native = True
        hook_dicts = [d for m in model.layers.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if getattr(attn, "qkv_proj", None) is None or getattr(mlp, "gate_up_proj", None) is None:
                return None
            fused = []  # per fused GEMM: (wrapper, first column, last column + 1) of each wrapped slice
            for parts in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
                cols = []
                for p in parts:
                    w, s = _unwrap(p)
                    if type(s) is not FusedSlice:
                        return None
                    if w is not None:
                        cols.append((w, s.lo, s.lo + s.out_features))
                fused.append(tuple(cols))
            unwrapped = [_unwrap(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if unwrapped[0][0] is not None or unwrapped[2][0] is not None:
                return None  # the fused GEMMs themselves wrapped: not a layout the plan knows
            gemms = [_gemm(base, dtype) for _, base in unwrapped]
            if any(g is None for g in gemms):
                return None
            max_rows = min([max_rows, *(rows for _, rows in gemms)])
            specs = [_native(base, dtype) for _, base in unwrapped]
            native = native and all(spec is not None for spec in specs)
            if native:
                for spec, tensors in specs:
                    proj += spec
                    weights += tensors
            (qkv, _), (o, _), (gate_up, _), (down, _) = gemms
            after = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
            post = layer.post_attention_layernorm
            norm_w = attn.qk_norm_weight
            if any(w is not None and w.dtype != dtype for w in (norm_w, post.weight, after.weight)):
                return None
            layers.append((i, qkv, o, gate_up, down, attn.num_heads, attn.num_kv_heads, norm_w,
                           attn.q_norm.eps if norm_w is not None else 0.0, attn.window or 0,
                           post.weight, post.eps, after.weight, after.eps))
            deltas.append((fused[0], unwrapped[1][0], fused[1], unwrapped[3][0]))
            norms += [norm_w if norm_w is not None else torch.empty(0, dtype=dtype), post.weight, after.weight]
            meta += [attn.num_heads, attn.num_kv_heads, attn.window or 0]
            eps += [attn.q_norm.eps if norm_w is not None else 0.0, post.eps, after.eps]
            wrappers += [w for cols in fused for w, _, _ in cols]
            wrappers += [w for w, _ in (unwrapped[1], unwrapped[3]) if w is not None]
        first = model.layers[0].input_layernorm
        return cls(layers, deltas, (first.weight, first.eps), wrappers, hook_dicts, max_rows, dtype,
                   (weights, proj, norms, meta, eps) if native and cpu_fused.has_decode_layers() else None)

    def applies(self, x: Tensor) -> int:
        """Whether this step may run the plan: 0 no; 1 every wrapper idle; 2 every wrapper adds its
        adapter's delta as one `lora_addmm_` of known rank rows (the steady decode of one adapter,
        `one_rows`): `run(..., deltas=True)`. Also x's rows and dtype, and no hook anywhere."""
        if x.dtype != self.dtype or x.shape[0] > self.max_rows or any(self.hook_dicts) or any(GLOBAL_HOOKS):
            return 0
        if all(w.idle for w in self.idles):
            return 1
        return 2 if self.wrappers and all(w.one_rows() is not None for w in self.wrappers) else 0

    def run(self, x: Tensor, attend: Callable, deltas: bool = False) -> Tensor:
        """x [T, H] (the embeddings) -> hidden [T, H] after the final norm; `attend(layer, qkv,
        heads, kv_heads, norm_w, eps, window)` is the step's `AttentionFn.qkv_decoder`. With
        `deltas`, each wrapper's delta is added where its module call would add it: in place into
        its columns of the fused output (q, k, v; gate, up) or onto the GEMM's output (o, down),
        one `lora_addmm_` of its `one_rows` each, in the module path's order."""
        step = getattr(attend, "step_args", None)  # the step's attention, for the C++ loop
        if self.native is not None and step is not None and NATIVE_LOOP:
            lora, lora_meta = self._delta_lists() if deltas else ([], [])
            weights, proj, norms, meta, eps = self.native
            return cpu_fused.decode_layers(x, *self.first, weights, proj, norms, meta, eps, *step, lora, lora_meta)
        add_rms_norm, silu_mul_halves, addmm = cpu_fused.add_rms_norm, cpu_fused.silu_mul_halves, cpu_fused.lora_addmm_
        h = cpu_fused.rms_norm(x, *self.first)
        for (i, qkv, o, gate_up, down, heads, kv_heads, norm_w, eps, window, post_w, post_eps, after_w,
             after_eps), (qkv_cols, o_w, gu_cols, down_w) in zip(self.layers, self.deltas):
            y = qkv(h)
            if deltas:
                for w, lo, hi in qkv_cols:
                    addmm(y[:, lo:hi], h, *w.one_rows())
            a = attend(i, y, heads, kv_heads, norm_w, eps, window)
            y = o(a)
            if deltas and o_w is not None:
                addmm(y, a, *o_w.one_rows())
            x, h = add_rms_norm(x, y, post_w, post_eps)
            y = gate_up(h)
            if deltas:
                for w, lo, hi in gu_cols:
                    addmm(y[:, lo:hi], h, *w.one_rows())
            m = silu_mul_halves(y)
            y = down(m)
            if deltas and down_w is not None:
                addmm(y, m, *down_w.one_rows())
            x, h = add_rms_norm(x, y, after_w, after_eps)
        return h

    def _delta_lists(self) -> tuple[list[Tensor], list[int]]:
        """This step's adapter deltas as `decode_layers` reads them: (a, b) of each wrapper's
        `one_rows` in `run`'s order, and per layer, for q/k/v, o, gate/up and down, a count and
        that many (lo, hi) column ranges of the site's output (hi -1: all of it)."""
        lora, lora_meta = [], []
        for (i, qkv, o, gate_up, down, *_), (qkv_cols, o_w, gu_cols, down_w) in zip(self.layers, self.deltas):
            for cols, whole in ((qkv_cols, None), (None, o_w), (gu_cols, None), (None, down_w)):
                if cols is None:
                    cols = () if whole is None else ((whole, 0, -1),)  # -1: the whole output
                lora_meta.append(len(cols))
                for w, lo, hi in cols:
                    lora += w.one_rows()
                    lora_meta += (lo, hi)
        return lora, lora_meta


# Whether a plan whose projections allow it runs its layers in C++ (`cpu_fused.decode_layers`);
# benchmarks and tests turn it off to compare with the Python loop in one process.
NATIVE_LOOP = True
