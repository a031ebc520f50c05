"""Per-request sampling over a batch of logits.

Each sequence with a seed draws from its own torch.Generator, so its tokens do not depend on its
batch neighbours. Logprobs are the model's raw distribution (before temperature / top-k / top-p,
penalties, logit_bias, min_p and min_tokens), as vLLM and OpenAI report them: `sample` never
writes into the logits it is given.

vLLM's extensions (SamplingParams.adjusts_logits) are applied per sequence, vectorized over the
rows that ask for any, in vLLM's order: min_tokens masks EOS and stop token ids, logit_bias adds,
then repetition / frequency / presence penalties, the greedy pick or the temperature, min_p, then
top-k / top-p; last of the adjustments, structured output masks a constrained row to the tokens
its grammar allows (`structured.mask_rows`, xgrammar's bitmask). Penalties touch only the entries of tokens a sequence has seen (from its prompt
and output ids, every step: Sequence keeps no tensors), so they cost what the sequences' lengths
cost, not the vocabulary; min_p computes on its own rows only. The one [B, V] cost is a copy
of the logits (the raw ones stay for the logprobs). A batch where no sequence asks for one takes
exactly the path it took before them (one attribute read per sequence:
SamplingParams.adjusts_logits, set when the parameters are made).
"""
from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

import numpy as np
import torch

from .sequence import Sequence
from .structured import mask_rows as grammar_mask
from ..types import TokenLogprob


def _filter_top_k_top_p(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """`logits / temps`, with everything outside each row's top-k and nucleus top-p at -inf.

    logits [B, V] float32; temps [B] (> 0); top_k [B] int64 (V = off); top_p [B] float32 (1 = off).
    Ranks come from the logits before the temperature: a huge temperature can flatten scaled
    logits to equal values (or zeros) in float32, and ranking those would keep arbitrary tokens.
    A row with top_p 1 keeps its whole tail: a float32 cumulative sum can reach 1.0 before the
    last tokens, and a neighbour's top_p must not cut them.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = sorted_logits / temps[:, None]  # a positive scale keeps the order
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _id_matrix(id_lists: Seq[Seq[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every id of every row, as two flat int64 tensors on `device`.
    Through numpy: several times faster than torch.tensor on a list of Python ints."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    flat = torch.from_numpy(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in id_lists]))
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    return rows.to(device), flat.to(device)


def adjust_logits(logits: torch.Tensor, seqs: Seq[Sequence],
                  eos_token_ids: Collection[int] = (), writable: bool = False) -> torch.Tensor:
    """min_tokens, logit_bias and the penalties, for rows whose sequence asks for them.

    logits [B, V] float32, written in place when `writable`, else copied first (a [32, 151936]
    copy is ~10 ms on a CPU core, paid by the whole batch when one row asks); returns [B, V]
    (the rows of the others unchanged: each row depends on its own sequence only). min_p is the
    sampler's, after the temperature."""
    dev, vocab = logits.device, logits.shape[-1]
    out = logits if writable else logits.clone()
    # min_tokens: EOS (unless ignored) and stop token ids cannot be sampled yet
    mask_rows, mask_ids = [], []
    for i, s in enumerate(seqs):
        p = s.params
        # (not under a grammar: its completion decides when EOS may come, and masking EOS
        # when it is the one token the grammar allows would leave the row nothing)
        if p.min_tokens and s.matcher is None and len(s.output_ids) < p.min_tokens:
            ids = [t for t in (p.stop_token_ids if p.ignore_eos
                               else [*eos_token_ids, *p.stop_token_ids]) if t < vocab]
            mask_rows += [i] * len(ids)
            mask_ids += ids
    if mask_ids:
        out[torch.tensor(mask_rows, device=dev), torch.tensor(mask_ids, device=dev)] = float("-inf")
    biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    if biased:
        rows = [i for i in biased for _ in seqs[i].params.logit_bias]
        ids = [t for i in biased for t in seqs[i].params.logit_bias]
        bias = [b for i in biased for b in seqs[i].params.logit_bias.values()]
        out.index_put_((torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                       torch.tensor(bias, dtype=out.dtype, device=dev), accumulate=True)
    penalized = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
                 or s.params.presence_penalty or s.params.frequency_penalty]
    if penalized:
        _penalize(out, penalized, [seqs[i] for i in penalized])
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:  # structured output: only the tokens each row's grammar allows
        grammar_mask(out, constrained, [seqs[i].matcher for i in constrained])
    return out


def _penalize(out: torch.Tensor, rows: list[int], seqs: Seq[Sequence]) -> None:
    """vLLM's penalties, in place on `out` [B, V] at rows `rows` (sequence `seqs[j]` for row
    rows[j]): repetition over prompt and output tokens, then frequency and presence over output
    tokens only. Sparse: only the entries of tokens a sequence has seen are read and written,
    so the cost follows the sequences' lengths, not the vocabulary."""
    dev, vocab = out.device, out.shape[-1]
    flat = out.view(-1)
    row_of = torch.tensor(rows, dtype=torch.int64, device=dev)
    # one key per (row, token): row * V + token
    out_rows, out_ids = _id_matrix([s.output_ids for s in seqs], dev)
    keys, counts = torch.unique(row_of[out_rows] * vocab + out_ids, return_counts=True)
    rep = [s.params.repetition_penalty for s in seqs]
    if any(r != 1.0 for r in rep):
        prompt_rows, prompt_ids = _id_matrix(
            [s.prompt_ids if r != 1.0 else () for s, r in zip(seqs, rep)], dev)
        out_seen = torch.tensor([r != 1.0 for r in rep], device=dev)[out_rows]
        seen = torch.unique(torch.cat([row_of[prompt_rows] * vocab + prompt_ids,
                                       (row_of[out_rows] * vocab + out_ids)[out_seen]]))
        by_row = torch.full((out.shape[0],), 1.0, dtype=out.dtype)
        by_row[rows] = torch.tensor(rep, dtype=out.dtype)
        penalty = by_row.to(dev)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    freq = torch.zeros(out.shape[0], dtype=out.dtype)
    freq[rows] = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=out.dtype)
    presence = torch.zeros(out.shape[0], dtype=out.dtype)
    presence[rows] = torch.tensor([s.params.presence_penalty for s in seqs], dtype=out.dtype)
    row = keys // vocab
    flat[keys] = flat[keys] - freq.to(dev)[row] * counts.to(out.dtype) - presence.to(dev)[row]


def _apply_min_p(logits: torch.Tensor, temps: torch.Tensor, min_p: torch.Tensor) -> None:
    """Tokens whose probability (after the temperature) is below min_p x the top token's, at -inf,
    in place, in the rows whose min_p is above 0 (the others are not computed on).
    logits [B, V] (adjust_logits' output: its copy, or the caller's writable rows); temps [B] (> 0); min_p [B]."""
    rows = (min_p > 0).nonzero().squeeze(-1)
    sub = logits[rows]
    probs = (sub / temps[rows, None]).softmax(dim=-1)
    keep = probs >= min_p[rows, None] * probs.max(dim=-1, keepdim=True).values
    logits[rows] = sub.masked_fill(~keep, float("-inf"))


def sample(logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator,
           eos_token_ids: Collection[int] = (), writable: bool = False) -> torch.Tensor:
    """Pick one token per row. logits [B, V] float32 (one row per seq) -> [B] int64.
    `eos_token_ids`: the ids min_tokens keeps from ending a sequence early (besides each
    sequence's stop_token_ids). `writable`: the caller reads `logits` no more (no logprobs
    asked), so adjustments may be made in place."""
    vocab = logits.shape[-1]
    if any([s.params.adjusts_logits for s in seqs]):  # a list: cheaper than a generator
        logits = adjust_logits(logits, seqs, eos_token_ids, writable)
        min_p = torch.tensor([s.params.min_p for s in seqs], dtype=torch.float32)
    else:
        min_p = None
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    greedy = temps == 0
    tokens = logits.argmax(dim=-1).cpu()
    if bool(greedy.all()):
        return tokens
    top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
    dev = logits.device
    temps = temps.clamp(min=1e-5).to(dev)
    if min_p is not None and bool((min_p > 0).any()):
        _apply_min_p(logits, temps, min_p.to(dev))  # logits is adjust_logits' copy
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        scaled = _filter_top_k_top_p(logits, temps, top_k.to(dev), top_p.to(dev))
    else:
        scaled = logits / temps[:, None]
    probs = scaled.softmax(dim=-1).float().cpu()
    # Gumbel-free exponential race: argmax(p / q), q ~ Exp(1), one draw vector per row
    for i, seq in enumerate(seqs):
        if greedy[i]:
            continue
        gen = seq.generator or default_gen
        q = torch.empty(vocab).exponential_(1.0, generator=gen)
        tokens[i] = (probs[i] / q).argmax()
    return tokens


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Raw logprob of each chosen token plus each row's top-k. logits [B, V]; chosen [B]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen.to(logp.device)[:, None]).squeeze(-1).tolist()
    kmax = max(ks) if ks else 0
    if kmax > 0:
        top_v, top_i = logp.topk(kmax, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for i, k in enumerate(ks):
        top = {top_i[i][j]: top_v[i][j] for j in range(k)} if k > 0 else {}
        out.append(TokenLogprob(int(chosen[i]), picked[i], top))
    return out
