"""One slice of training over several runs at once: their datums as rows of ONE batch through the
resident base, each row with its own run's LoRA (hooks.attached_rows), one backward for all.

Why: a slice's cost on the base (reading every weight, the packed layers' backward products) is
paid once for the batch instead of once per run, as the serving path batches adapters; runs that
train at the same time then take less than one after another (MinT's 3-policy figure).

Exactness: rows of different runs share no computation that mixes them. Attention is per datum
(`segmented_attention`), every other op is per row, and a run's factors touch only its rows, so
d(sum of all runs' losses)/d(run r's factors) is exactly run r's own gradient; the only
difference to training it alone is the order of float sums inside the batched matmuls. A run whose
loss is not finite fails alone: its rows are left out of the backward, the others' step stands.

`pick` chooses the rows: whole datums, one per pass in turn, while they fit the slice budget, so
runs share a slice fairly and a datum longer than the budget (chunked.py) never enters a group.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from loraserve.model.layers import causal_attention
from loraserve.train.chunked import target_logprobs
from loraserve.train.config import TrainingError
from loraserve.train.hooks import attached_rows
from loraserve.train.losses import loss_spec

# run.Pass and run.Datum (run.py imports this module, so they are not named here)
Pass = Any
Datum = Any


def segmented_attention(segments: list[tuple[int, int]]):
    """An AttentionFn over a batch of whole sequences: rows s..e-1 of each segment are one causal
    sequence, attending to nothing outside it."""
    def attn(layer: int, q: Tensor, k: Tensor, v: Tensor, *, window: int | None = None) -> Tensor:
        return torch.cat([causal_attention(q[s:e], k[s:e], v[s:e], window) for s, e in segments])
    return attn


def pick(passes: list[Pass], max_tokens: int) -> list[tuple[Pass, list[Datum]]]:
    """The datums of one slice: the next whole datum of each pass in turn (the first pass first),
    while it fits in what is left of `max_tokens`; passes that got none are left out."""
    taken: list[list[Datum]] = [[] for _ in passes]
    room, more = max_tokens, True
    while more:
        more = False
        for p, mine in zip(passes, taken):
            i = p.done_datums + len(mine)
            if i < len(p.data) and p.data[i].num_tokens <= room:
                mine.append(p.data[i])
                room -= p.data[i].num_tokens
                more = True
    return [(p, mine) for p, mine in zip(passes, taken) if mine]


def _rows(picks: list[tuple[Pass, list[Datum]]]) -> tuple[Tensor, Tensor, Tensor, list[tuple[int, int]]]:
    """(tokens [T], positions [T], target tokens [T], each datum's rows), datums in pick order."""
    datums = [d for _, ds in picks for d in ds]
    bounds, s = [], 0
    for d in datums:
        bounds.append((s, s + d.num_tokens))
        s += d.num_tokens
    device = datums[0].tokens.device
    positions = torch.cat([torch.arange(d.num_tokens, device=device) for d in datums])
    targets = torch.cat([d.inputs["target_tokens"] for d in datums])
    return torch.cat([d.tokens for d in datums]), positions, targets, bounds


def run_group(picks: list[tuple[Pass, list[Datum]]]) -> dict[Pass, TrainingError]:
    """Forward (and, for passes that want it, backward) of every picked datum in one batch; each
    pass gets its datums' outputs and its gradients. Returns the passes that failed (a loss not
    finite), which got nothing."""
    tokens, positions, targets, bounds = _rows(picks)
    model, backward = picks[0][0].run.model, any(p.backward for p, _ in picks)
    runs, losses, outs, failed, i = [], {}, {}, {}, 0
    for p, ds in picks:
        runs.append((p.run.factors, bounds[i][0], bounds[i + len(ds) - 1][1]))
        i += len(ds)
    with torch.inference_mode(False), torch.set_grad_enabled(backward), attached_rows(model, runs):
        lp = target_logprobs(model, model(tokens, positions, segmented_attention(bounds)), targets)
        i = 0
        for p, ds in picks:
            spec = loss_spec(p.loss)
            outs[p] = [(lp[s:e], spec.fn(lp[s:e], d.inputs, p.loss_config)) for d, (s, e) in zip(ds, bounds[i:])]
            i += len(ds)
            sums = [float(el.detach().sum()) for _, el in outs[p]]
            bad = next((j for j, x in enumerate(sums) if not math.isfinite(x)), None)
            if bad is not None:
                failed[p] = TrainingError(f"{p.loss} loss of datum {p.done_datums + bad} is {sums[bad]}: "
                                          "the step failed and the run is unchanged")
            elif p.backward:
                losses[p] = torch.stack([el.sum() for _, el in outs[p]]).sum()
        if losses:
            params = [list(p.run.factors.parameters()) for p in losses]
            flat = torch.autograd.grad(sum(losses.values()), [t for ps in params for t in ps])
            k = 0
            for p, ps in zip(losses, params):
                p.accumulate(flat[k:k + len(ps)])
                k += len(ps)
    for p, _ in picks:
        if p not in failed:
            for (target_lp, elementwise), d in zip(outs[p], dict(picks)[p]):
                p.ran(d, target_lp, elementwise)
    return failed
