"""Attach a run's factors to the resident serving model for one forward, and take them off.

Forward hooks on the target modules add `scale * B(A x)` to each output; nothing of the model is
replaced or copied, so decode steps between training slices see the model exactly as before.
`attached_rows` does it for several runs at once, each on its own contiguous rows of one batch
(the serving path's segmented LoRA, in training): one pass over the base for all of them.
The hooks act only outside inference mode, where every training forward runs: a serving step,
which runs in inference mode, passes through them untouched while a slice that gave way to it
part way holds them (train/preempt.py).
The hooks go on whatever sits at the target path: a plain `nn.Linear`, a `PackedLinear`, or the
serving LoRA wrapper around either (the host clears the serving LoRA state first, so the wrapper
adds nothing of its own during a training forward).

`PackedLinear` (model/prepack.py) multiplies through a oneDNN op with no autograd formula: the
gradient would silently stop there. `_PackedInputGrad` gives it one: dx = dy W, with W unpacked
for that one backward product and dropped after (one layer's transient copy, never a resident
second base). Plain `nn.Linear` weights are frozen Parameters and differentiate as they are.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loraserve.model import CausalLM
from loraserve.model.moe import ExpertLinear
from loraserve.model.prepack import PackedLinear
from loraserve.train.factors import LoRAFactors


class _PackedInputGrad(torch.autograd.Function):
    """Identity on the packed op's output y; backward gives x its gradient dy @ W."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, module: PackedLinear) -> Tensor:  # noqa: ARG004
        ctx.module = module
        return y.clone()

    @staticmethod
    def backward(ctx, dy: Tensor):
        w = ctx.module.packed.to_dense()  # [out, in], this product only
        return dy.reshape(-1, dy.shape[-1]).mm(w.to(dy.dtype)).view(*dy.shape[:-1], w.shape[1]), None, None


def _packed_hook(module: PackedLinear, args: tuple, output: Tensor) -> Tensor | None:
    x = args[0]
    if not x.requires_grad:
        return None
    return _PackedInputGrad.apply(x, output.detach(), module)


Part = tuple[int, "int | None", "tuple[nn.Parameter, nn.Parameter] | None", float]  # rows s..e-1, factors, scale


def _rows_hook(parts: list[Part]):
    """Rows s..e-1 of the batch (e None: to the end) get their run's `scale * B(A x)` (none where
    the pair is None: that run does not train this module)."""
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if torch.is_inference_mode_enabled():  # a serving step while the slice is parked (preempt.py)
            return None
        x = args[0]
        deltas = []
        for s, e, pair, scale in parts:
            if pair is None:
                deltas.append(output.new_zeros(x[s:e].shape[0], output.shape[-1]))
            else:
                a, b = pair
                deltas.append((F.linear(F.linear(x[s:e].to(a.dtype), a), b) * scale).to(output.dtype))
        return output + (deltas[0] if len(deltas) == 1 else torch.cat(deltas))
    return hook


def _per_expert(x: Tensor, expert_ids: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """B[e](A[e] x) for (token, expert) pairs grouped by expert: x [P, in] -> [P, out]
    (a [E, r, in], b [E, out, r]); one product pair per expert that has rows."""
    counts = torch.bincount(expert_ids, minlength=a.shape[0]).tolist()
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(F.linear(F.linear(x[start:start + n].to(a.dtype), a[e]), b[e]))
            start += n
    return torch.cat(outs)


def _experts_hook(parts: list[Part]):
    """As `_rows_hook` for packed experts (`ExpertLinear(x, expert_ids, token_index)`): its rows
    are (token, expert) pairs, each pair is its token's run's (token_index in s..e-1)."""
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if torch.is_inference_mode_enabled():
            return None
        x, expert_ids, token_index = args
        delta = output.new_zeros(output.shape, dtype=torch.float32)
        for s, e, pair, scale in parts:
            if pair is None:
                continue
            mine = token_index >= s if e is None else (token_index >= s) & (token_index < e)
            rows = mine.nonzero().view(-1)  # still grouped by expert
            if rows.numel():
                delta = delta.index_add(0, rows, _per_expert(x[rows], expert_ids[rows], *pair).float() * scale)
        return output + delta.to(output.dtype)
    return hook


def _target(model: CausalLM, path: str) -> nn.Module:
    return model.get_submodule(path if path == "lm_head" else f"model.{path}")


@contextmanager
def _hooked(model: CausalLM, hooks: dict[str, object]) -> Iterator[None]:
    """`hooks` (module path -> forward hook) and the packed layers' input gradient, on until exit."""
    handles = [m.register_forward_hook(_packed_hook) for m in model.modules() if isinstance(m, PackedLinear)]
    try:
        for path, hook in hooks.items():
            handles.append(_target(model, path).register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


def attached(model: CausalLM, factors: LoRAFactors):
    """Within the block, `model(...)` computes base + this run's LoRA, differentiable in the factors
    (and in every activation, packed layers included). Hooks are removed on exit, error or not."""
    return attached_rows(model, [(factors, 0, None)])


def attached_rows(model: CausalLM, runs: list[tuple[LoRAFactors, int, int | None]]):
    """As `attached`, for several runs in one batch: rows s..e-1 (contiguous, in order, covering
    the batch) computed with that run's factors. Runs may train different modules and ranks."""
    hooks = {}
    for path in dict.fromkeys(path for factors, _, _ in runs for path in factors.pairs):
        parts = [(s, e, f.pairs.get(path), f.config.scale) for f, s, e in runs]
        module = _target(model, path)
        experts = isinstance(getattr(module, "base", module), ExpertLinear)  # bare or in a serving wrapper
        hooks[path] = _experts_hook(parts) if experts else _rows_hook(parts)
    return _hooked(model, hooks)
