"""One datum longer than the slice budget: its forward in chunks of at most `budget` tokens and its
backward in chunks of at most `backward_budget` (a third of it as the run sizes it: a backward
chunk computes its forward again and twice that backward, so its work, in forward tokens, stays
within the budget), one chunk per slice, so neither its activations nor its time in one slice
grow with its length. The two partitions need not match: a backward chunk reads the keys/values
the forward phase kept for every position.

Two phases over chunks c = tokens[s:e]:

    forward, in order, no autograd    chunk c attends over the keys/values of chunks < c (kept
                                      per layer, [T, Hkv, D]) and its own; its target logprobs and
                                      elementwise loss are the datum's outputs
    backward, last chunk first        chunk c's forward again, with autograd, the earlier chunks'
                                      keys/values as leaves; backward from its loss and from the
                                      gradient later chunks sent to its own keys/values (dK, dV,
                                      kept per layer); what reaches the earlier keys/values is
                                      added to theirs

By the chain rule the factor gradients summed over chunks are the unsplit datum's (every Tinker
loss is a sum over positions). Each backward chunk runs its layers under `torch.utils.checkpoint`,
so what autograd holds is one layer input per layer plus one layer's internals: activations are
bounded by the chunk, save the attention scores [Hq, t, s + t] of one layer and the keys/values
(and their gradients) of the whole datum, a few KB per token.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from loraserve.model import CausalLM
from loraserve.train.factors import LoRAFactors
from loraserve.train.hooks import attached
from loraserve.train.losses import LossSpec


QUERY_BLOCK = 128  # queries per block of a chunk's attention (the longest stretch between two points)


def _nothing() -> None:
    pass


def blocked_prefix_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, window: int | None = None,
                             point: Callable[[], None] = _nothing) -> Tensor:
    """`prefix_attention` in blocks of QUERY_BLOCK queries, each over the keys up to its last
    query, with `point()` between two blocks, in the forward and before each block's backward
    (train/preempt.py: a slice gives way there). A chunk of a long datum attends over up to the
    whole datum: one block is the longest piece of its work between two points.

    q [t, Hq, D], k/v [S, Hkv, D] with S = q_start + t -> [t, Hq, D].
    """
    outs = []
    for b in range(0, q.shape[0], QUERY_BLOCK):
        if b:
            point()
        e = min(b + QUERY_BLOCK, q.shape[0])
        out = prefix_attention(q[b:e], k[:q_start + e], v[:q_start + e], q_start + b, window)
        if out.requires_grad:
            out.register_hook(lambda grad: point())
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, window: int | None = None) -> Tensor:
    """Causal attention of the queries at positions q_start.. over keys at positions 0..:
    out[i] = softmax(q[i] k[:q_start+i+1]^T / sqrt(D)) v (only the last `window` keys with a
    window). The model's `causal_attention` is the case q_start = 0 (same math, same dtypes).

    q [t, Hq, D], k/v [S, Hkv, D] with S = q_start + t -> [t, Hq, D].
    """
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5       # [Hq, t, S]
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + q_start
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.einsum("hqk,khd->qhd", probs.to(q.dtype), v)


def target_logprobs(model: CausalLM, hidden: Tensor, targets: Tensor) -> Tensor:
    """log p(targets[i] | hidden[i]) [t] float32 (hidden [t, H] after the final norm)."""
    logits = model.compute_logits(hidden)                                        # [t, V] float32
    return torch.log_softmax(logits, -1).gather(1, targets.view(-1, 1)).view(-1)


def _checkpointed_hidden(model: CausalLM, tokens: Tensor, positions: Tensor, attn: Callable) -> Tensor:
    """DecoderModel.forward with each layer under activation checkpointing (recomputed in backward)."""
    inner = model.model
    x = inner.embed_tokens(tokens)
    rope = inner.rotary_emb(positions, x.dtype)
    for layer in inner.layers:
        x = checkpoint(layer, x, rope, attn, use_reentrant=False)
    return inner.norm(x)


class ChunkedDatum:
    """The forward (and backward) of one datum, a chunk per `step()`; `grads` (the factors') and
    `logprobs` / `elementwise` [T] once `done`."""

    def __init__(self, model: CausalLM, factors: LoRAFactors, tokens: Tensor, inputs: Mapping[str, Tensor],
                 spec: LossSpec, loss_config: Mapping[str, float], budget: int, backward: bool,
                 backward_budget: int | None = None):
        self.model, self.factors, self.tokens, self.inputs = model, factors, tokens, inputs
        self.spec, self.loss_config, self.backward = spec, loss_config, backward
        n = tokens.numel()
        self.bounds = [(s, min(s + budget, n)) for s in range(0, n, budget)]
        step = max(1, backward_budget or budget)
        self.back_bounds = [(s, min(s + step, n)) for s in range(0, n, step)]
        self.keys: list[Tensor] = []     # per layer [T, Hkv, D], written by the forward phase
        self.values: list[Tensor] = []
        self.dkeys: list[Tensor] = []    # per layer [T, Hkv, D], gradient sent back by later chunks
        self.dvalues: list[Tensor] = []
        self.logprobs = torch.empty(n, device=tokens.device)                  # [T] float32
        self.elementwise = torch.empty(n, device=tokens.device)               # [T] float32
        self.grads: list[Tensor] | None = None
        self.forward_next, self.backward_next = 0, len(self.back_bounds) - 1
        self.point: Callable[[], None] = _nothing  # the step in progress's preemption point

    @property
    def forward_done(self) -> bool:
        return self.forward_next == len(self.bounds)

    @property
    def done(self) -> bool:
        return self.forward_done and (not self.backward or self.backward_next < 0)

    def step(self, point: Callable[[], None] = _nothing) -> int:
        """Run the next chunk: forward chunks in order, then (with backward) backward chunks last
        first; the chunk's token count. `point()` is called between its attention's query
        blocks (`blocked_prefix_attention`)."""
        self.point = point
        with torch.inference_mode(False), attached(self.model, self.factors):
            if not self.forward_done:
                s, e = self.bounds[self.forward_next]
                with torch.no_grad():
                    self._forward_chunk(s, e)
                self.forward_next += 1
            else:
                s, e = self.back_bounds[self.backward_next]
                self._backward_chunk(s, e)
                self.backward_next -= 1
        return e - s

    def _loss(self, s: int, e: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(target logprobs, elementwise loss) of positions s..e-1."""
        lp = target_logprobs(self.model, hidden, self.inputs["target_tokens"][s:e])
        return lp, self.spec.fn(lp, {k: t[s:e] for k, t in self.inputs.items()}, self.loss_config)

    def _forward_chunk(self, s: int, e: int) -> None:
        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor, *, window: int | None = None) -> Tensor:
            if layer == len(self.keys):  # first chunk: the datum's keys/values, allocated once
                self.keys.append(k.new_empty(self.tokens.numel(), *k.shape[1:]))
                self.values.append(v.new_empty(self.tokens.numel(), *v.shape[1:]))
            self.keys[layer][s:e], self.values[layer][s:e] = k, v
            return blocked_prefix_attention(q, self.keys[layer][:e], self.values[layer][:e], s, window, self.point)

        hidden = self.model(self.tokens[s:e], torch.arange(s, e, device=self.tokens.device), attn)
        lp, elementwise = self._loss(s, e, hidden)
        self.logprobs[s:e], self.elementwise[s:e] = lp, elementwise

    def _backward_chunk(self, s: int, e: int) -> None:
        """Chunk s..e-1's gradient: to the factors (summed into `grads`) and to the keys/values of
        the chunks before it (summed into `dkeys` / `dvalues`)."""
        if not self.dkeys:
            self.dkeys = [torch.zeros_like(k) for k in self.keys]
            self.dvalues = [torch.zeros_like(v) for v in self.values]
        prefix = [(k[:s].detach().requires_grad_(), v[:s].detach().requires_grad_())
                  for k, v in zip(self.keys, self.values)]
        own: dict[int, tuple[Tensor, Tensor]] = {}

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor, *, window: int | None = None) -> Tensor:
            own[layer] = (k, v)
            pk, pv = prefix[layer]
            return blocked_prefix_attention(q, torch.cat([pk, k]), torch.cat([pv, v]), s, window, self.point)

        positions = torch.arange(s, e, device=self.tokens.device)
        hidden = _checkpointed_hidden(self.model, self.tokens[s:e], positions, attn)
        loss = self._loss(s, e, hidden)[1].sum()
        outputs, grad_out = [loss], [torch.ones_like(loss)]
        for layer, (k, v) in own.items():  # the last chunk's keys/values feed no later chunk
            for t, g in ((k, self.dkeys[layer][s:e]), (v, self.dvalues[layer][s:e])):
                if e < self.tokens.numel() and t.requires_grad:  # a layer before any factor: none
                    outputs.append(t)
                    grad_out.append(g)
        params = self.factors.parameters()
        leaves = [t for pair in prefix for t in pair] if s > 0 else []
        grads = torch.autograd.grad(outputs, params + leaves, grad_out, allow_unused=True)
        self._add(grads[:len(params)], params)
        for i, g in enumerate(grads[len(params):]):
            if g is not None:
                (self.dkeys if i % 2 == 0 else self.dvalues)[i // 2][:s].add_(g)

    def _add(self, grads: tuple[Tensor | None, ...], params: list[Tensor]) -> None:
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        if self.grads is None:
            self.grads = [g.detach().clone() for g in grads]
        else:
            for acc, g in zip(self.grads, grads):
                acc.add_(g)
