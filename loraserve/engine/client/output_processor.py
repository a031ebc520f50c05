"""The API server's side of the output path: text, stop strings and delivery, per request.

The engine core sends token-id deltas (`output.TokenOutputs`): ids, logprobs and the finish
reasons it decides itself (EOS and stop token ids, max_tokens and the context length, errors).
`OutputProcessor` turns them into what the server reads, in the API server's process, so that
this work is not on the engine step and several API servers share it. One lives in each
`EngineClient`, whatever its transport (thread, process, Ray), so every hosting gives the
same outputs:

- incremental detokenization, one `IncrementalDetokenizer` per request;
- special tokens' text left out unless the request says `skip_special_tokens=False`;
- stop strings (looked for once more than `min_tokens` tokens exist, as vLLM does): the text is
  cut before the first match (after it with `include_stop_str_in_output`, which also keeps the
  text of the EOS or stop token that ended a request), the delta's tokens end with the token
  that completed it, its finish reason becomes "stop", and the request is reported for an abort
  in the core, which frees its KV blocks and adapter slot (deltas the core sent meanwhile are
  dropped here);
- while a request runs, the last `len(longest stop) - 1` characters are held back: a stop string
  may still begin there;
- non-streamed requests (`GenerateRequest.stream=False`): the first delta is handed over at once,
  the rest are merged into one delta handed over at the end, so the reader is not woken per token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...tokenizer import IncrementalDetokenizer, Tokenizer
from ..types import FIRST, GenerateRequest, RequestOutput, coalesce


@dataclass(slots=True, eq=False)
class _RequestState:
    stop: list[str]
    hold: int                        # characters held back while running (longest stop - 1)
    detok: IncrementalDetokenizer
    stream: bool
    min_tokens: int = 0              # stop strings are looked for only past this many tokens
    include_stop: bool = False       # the stop string (or stop token) stays in the text
    num_tokens: int = 0              # output tokens detokenized so far
    text: str = ""                   # output text so far, cut at a stop string
    num_text_emitted: int = 0
    # non-streamed: FIRST (first delta not out yet), None (nothing held) or the merged deltas
    # since the first
    held: object = FIRST


class OutputProcessor:
    """Core deltas -> the deltas a request's reader gets. Event loop only: no locking."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add(self, req: GenerateRequest) -> None:
        """Track req from its submission on (before any of its deltas can arrive)."""
        p = req.params
        stop = list(p.stop)
        self._requests[req.request_id] = _RequestState(
            stop, max(map(len, stop), default=1) - 1,
            self.tokenizer.detokenizer(p.skip_special_tokens), req.stream, p.min_tokens,
            p.include_stop_str_in_output)

    def remove(self, request_id: str) -> None:
        """Forget request_id (its reader is gone); later deltas for it are dropped."""
        self._requests.pop(request_id, None)

    def process(self, outs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One batch of core deltas -> (deltas to hand to readers, request ids a stop string
        ended that the core still runs: abort them there)."""
        ready: list[RequestOutput] = []
        ended: list[str] = []
        for out in outs:
            st = self._requests.get(out.request_id)
            if st is None:
                continue  # finished here already (a stop string) or nobody waits for it
            if out.error is None:
                running = out.finish_reason is None
                out = self._detokenize(st, out)
                if running and out.finish_reason is not None:
                    ended.append(out.request_id)
            last = out.finish_reason is not None or out.error is not None
            if last:
                del self._requests[out.request_id]
            out = out if st.stream else self._coalesce(st, out, last)
            if out is not None:
                ready.append(out)
        return ready, ended

    def _detokenize(self, st: _RequestState, out: RequestOutput) -> RequestOutput:
        """Fill in out's text; cut it at a stop string (truncating out there and finishing it)."""
        ids, finish = out.token_ids, out.finish_reason
        # the core ends "stop" on the EOS / stop token itself, which is not part of the text
        # (unless the request keeps it: include_stop_str_in_output)
        n_text = len(ids) - 1 if finish == "stop" and not st.include_stop else len(ids)
        for i in range(n_text):
            before = len(st.text)
            st.text += st.detok.step(ids[i])
            if finish in ("length", "stop") and i == len(ids) - 1:
                st.text += st.detok.flush()  # bytes held back for an incomplete UTF-8 sequence
            st.num_tokens += 1
            if st.stop and st.num_tokens > st.min_tokens and self._cut_stop(st, before):
                out = _truncated(out, i + 1)
                finish = out.finish_reason = "stop"
                break
        end = len(st.text)
        if finish is None:
            end -= st.hold  # hold back a possible stop prefix
        end = max(end, st.num_text_emitted)
        out.text = st.text[st.num_text_emitted:end]
        st.num_text_emitted = end
        return out

    @staticmethod
    def _cut_stop(st: _RequestState, before: int) -> bool:
        """Cut st.text at the earliest stop string (after it when the request keeps it), looking
        only where one could have been completed by the text added after `before`."""
        lo = max(0, before - st.hold)
        hits = [(i, len(s)) for s in st.stop if (i := st.text.find(s, lo)) >= 0]
        if not hits:
            return False
        at, length = min(hits, key=lambda hit: hit[0])
        st.text = st.text[: at + length if st.include_stop else at]
        return True

    @staticmethod
    def _coalesce(st: _RequestState, out: RequestOutput, last: bool) -> RequestOutput | None:
        """Non-streamed: the first delta as it is, then nothing until the last, which carries
        every delta since the first merged."""
        st.held, send = coalesce(st.held, out, last)
        return send


def _truncated(out: RequestOutput, n: int) -> RequestOutput:
    """out with only its first n tokens (a stop string ended the request at the n-th)."""
    cut = len(out.token_ids) - n
    return dataclasses.replace(out, token_ids=out.token_ids[:n], text="",
                               logprobs=None if out.logprobs is None else out.logprobs[:n],
                               num_output_tokens=out.num_output_tokens - cut)
