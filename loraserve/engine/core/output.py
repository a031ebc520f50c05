"""The engine core's side of the output path: stop conditions it decides, token-id deltas.

The core decides only what needs no text: EOS and `stop_token_ids` ("stop", never before
`min_tokens` tokens), `max_tokens` and the context length ("length"), errors and aborts. Its
deltas carry token ids and logprobs and an empty `text`; detokenization and stop strings run in
the API server's process (`output_processor.OutputProcessor`), which aborts a request in the
core when one of its stop strings ends it. Keeping text out of the core keeps that work off the
engine step.
"""
from __future__ import annotations

import time

import torch

from .sampler import token_logprobs
from .sequence import Sequence
from ..types import RequestOutput, TokenLogprob


def _timings(seq: Sequence) -> tuple[float, float, float]:
    """(queue_s, prefill_s, decode_s) of a finishing sequence (RequestOutput.timings); a part it
    never reached (no token: a zero-token answer) is 0."""
    end = time.monotonic()
    scheduled = seq.scheduled_time if seq.scheduled_time is not None else end
    first = seq.first_token_time if seq.first_token_time is not None else end
    return scheduled - seq.arrival, max(first - scheduled, 0.0), max(end - first, 0.0)


class TokenOutputs:
    def __init__(self, eos_token_ids: list[int], max_model_len: int):
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len

    def set_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """logits [P-1, V]: row i predicts prompt token i+1."""
        k = seq.params.prompt_logprobs or 0
        targets = torch.tensor(seq.prompt_ids[1:], dtype=torch.int64)
        lps: list[TokenLogprob | None] = [None]
        if len(targets):
            lps.extend(token_logprobs(logits, targets, [k] * len(targets)))
        seq.prompt_logprobs = lps

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Add one sampled token and decide whether seq is finished. A "stop" set here always
        ends on the stop token itself: the API side relies on that to leave it out of the text."""
        p = seq.params
        seq.output_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        m = seq.matcher
        if m is not None:  # structured output: advance the grammar; terminated = done
            if not m.accept_token(token):
                raise RuntimeError(f"token {token} does not follow the request's grammar")
            if m.is_terminated():
                seq.finish_reason = "stop"
                return
        # before min_tokens tokens nothing but the length ends it (the sampler masks EOS and
        # stop token ids until then: this only guards that)
        if len(seq.output_ids) > p.min_tokens and (
                (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"

    def delta(self, seq: Sequence) -> RequestOutput | None:
        """The tokens seq produced since the last delta; None if nothing new and not finished."""
        new_ids = seq.output_ids[seq.num_emitted:]
        if not new_ids and seq.finish_reason is None:
            return None
        out = RequestOutput(
            request_id=seq.request_id, token_ids=new_ids, text="",
            logprobs=seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.num_emitted == 0 else None,
            finish_reason=seq.finish_reason, num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            adapter_revision=seq.adapter_key[1] if seq.adapter_key else None,
            adapter_tier=seq.adapter_tier if seq.num_emitted == 0 else None,
            timings=_timings(seq) if seq.finish_reason is not None else None)
        seq.num_emitted = len(seq.output_ids)
        return out

    def error(self, seq: Sequence, err: Exception) -> RequestOutput:
        return RequestOutput.failed(seq.request_id, err, len(seq.prompt_ids))
