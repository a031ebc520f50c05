"""Post-processing of sampled tokens: stop conditions, incremental text, output deltas."""
from __future__ import annotations

import torch

from .sampler import token_logprobs
from .sequence import Sequence
from .types import RequestOutput, TokenLogprob


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
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
        """Add one sampled token and decide whether seq is finished."""
        p = seq.params
        seq.output_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
            return
        before = len(seq.text)
        seq.text += seq.detok.step(token)
        if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"
            seq.text += seq.detok.flush()  # bytes held back for an incomplete UTF-8 sequence
        if p.stop and self._cut_stop(seq, before):
            seq.finish_reason = "stop"

    def _cut_stop(self, seq: Sequence, before: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        lo = max(0, before - longest + 1)
        hits = [i for i in (seq.text.find(s, lo) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        return True

    def delta(self, seq: Sequence) -> RequestOutput | None:
        """What seq produced since the last delta; None if nothing new and not finished."""
        new_ids = seq.output_ids[seq.num_emitted:]
        end = len(seq.text)
        if seq.finish_reason is None and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1  # hold back a possible stop prefix
        end = max(end, seq.num_text_emitted)
        text = seq.text[seq.num_text_emitted:end]
        if not new_ids and not text and seq.finish_reason is None:
            return None
        out = RequestOutput(
            request_id=seq.request_id, token_ids=new_ids, text=text,
            logprobs=seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.num_emitted == 0 else None,
            finish_reason=seq.finish_reason, num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            adapter_revision=seq.adapter_key[1] if seq.adapter_key else None)
        seq.num_emitted = len(seq.output_ids)
        seq.num_text_emitted = end
        return out

    def error(self, seq: Sequence, err: Exception) -> RequestOutput:
        return RequestOutput(seq.request_id, [], "", finish_reason="error",
                             num_prompt_tokens=len(seq.prompt_ids), error=err)
