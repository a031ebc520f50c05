"""Perplexity of a text under the engine's model, computed the way llama.cpp's `llama-perplexity`
computes it, so the two figures compare on the same GGUF file:

- the text is tokenized whole (with the tokenizer's BOS only if the model adds one: GGUF
  `tokenizer.ggml.add_bos_token`) and cut into consecutive chunks of `n_ctx` tokens (the tail
  shorter than a chunk is dropped);
- each chunk is a fresh context (its first token replaced by BOS when the model adds one);
- only the second half is scored: the negative log-likelihood of tokens `n_ctx/2 + 1` to
  `n_ctx - 1` of each chunk, each given all the chunk's tokens before it;
- perplexity = exp(mean NLL over every scored token of every chunk).

The engine computes the log-probabilities as it serves them (`prompt_logprobs`: the prompt's
prefill, whatever the base's weights are: float or quantized), so the figure is the served
model's. Used by `bench/perplexity.py` and the quantized-base tests.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .engine.types import GenerateRequest, SamplingParams


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float     # mean negative log-likelihood (nats per scored token)
    scored: int    # tokens scored
    chunks: int


def chunks_of(ids: list[int], n_ctx: int, max_chunks: int | None = None,
              bos: int | None = None) -> list[list[int]]:
    """The text's consecutive n_ctx-token chunks (the first token of each BOS when given)."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    n = len(ids) // n_ctx if max_chunks is None else min(len(ids) // n_ctx, max_chunks)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one chunk of {n_ctx}")
    chunks = [list(ids[i * n_ctx:(i + 1) * n_ctx]) for i in range(n)]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def perplexity(engine, ids: list[int], n_ctx: int, max_chunks: int | None = None,
               bos: int | None = None, adapter: str | None = None) -> Perplexity:
    """The perplexity of token ids `ids` under `engine` (an LLMEngine on its owner thread), each
    chunk a request of its own that asks for its prompt's log-probabilities, all in one batch."""
    chunks = chunks_of(ids, n_ctx, max_chunks, bos)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    seqs = [engine.add_request(GenerateRequest(f"ppl-{time.monotonic_ns()}-{i}", c, params, adapter))
            for i, c in enumerate(chunks)]
    while engine.has_work():
        engine.step()
    first = n_ctx // 2
    nll, scored = 0.0, 0
    for seq in seqs:
        lps = seq.prompt_logprobs
        if lps is None or len(lps) != n_ctx:
            raise RuntimeError(f"request {seq.request_id} ended without its prompt log-probabilities"
                               f" ({getattr(seq, 'error', None) or 'no error recorded'})")
        for entry in lps[first + 1:]:  # entry i: log p(token i | tokens before it)
            nll -= entry.logprob
            scored += 1
    mean = nll / scored
    return Perplexity(math.exp(mean), mean, scored, len(chunks))
