"""Per-request sampling over a batch of logits.

Each sequence with a seed draws from its own torch.Generator, so its tokens do not depend on its
batch neighbours. Logprobs are the model's raw distribution (before temperature / top-k / top-p),
as vLLM and OpenAI report them.
"""
from __future__ import annotations

import torch

from .sequence import Sequence
from .types import TokenLogprob


def _filter_top_k_top_p(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """`logits / temps`, with everything outside each row's top-k and nucleus top-p at -inf.

    logits [B, V] float32; temps [B] (> 0); top_k [B] int64 (V = off); top_p [B] float32 (1 = off).
    Ranks come from the logits before the temperature: a huge temperature can flatten scaled
    logits to equal values (or zeros) in float32, and ranking those would keep arbitrary tokens.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = sorted_logits / temps[:, None]  # a positive scale keeps the order
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator) -> torch.Tensor:
    """Pick one token per row. logits [B, V] float32 (one row per seq) -> [B] int64."""
    vocab = logits.shape[-1]
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    greedy = temps == 0
    tokens = logits.argmax(dim=-1).cpu()
    if bool(greedy.all()):
        return tokens
    top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
    dev = logits.device
    temps = temps.clamp(min=1e-5).to(dev)
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
