"""Token logprobs in OpenAI's two shapes: legacy completions and chat `content` entries."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraserve.engine.types import TokenLogprob

# JSON has no -inf/NaN; vLLM answers with this floor too.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


@dataclass(slots=True)
class TokenRenderer:
    """Renders a token id as text: its vocabulary text, or `token_id:{id}` (vLLM option)."""

    tokenizer: Any
    as_token_ids: bool = False

    def __call__(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)


@dataclass(slots=True)
class LegacyLogprobs:
    """Completions `logprobs`: parallel lists, text_offset counted in characters of `text`."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def extend(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None],
               render: TokenRenderer, offset: int, top_k: int) -> int:
        """Append one entry per token (entry None: no logprob, e.g. first prompt token).

        Returns the character offset after the last token.
        """
        for token_id, entry in zip(ids, entries):
            text = render(token_id)
            self.tokens.append(text)
            self.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(finite(entry.logprob))
            self.top_logprobs.append(_top_dict(entry, render, top_k))
        return offset

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def _top_dict(entry: TokenLogprob, render: TokenRenderer, top_k: int) -> dict[str, float]:
    """The chosen token plus the top_k alternatives, as {token text: logprob}."""
    top = {render(entry.token_id): finite(entry.logprob)}
    for token_id, lp in _ranked(entry)[:top_k]:
        top.setdefault(render(token_id), finite(lp))
    return top


def _ranked(entry: TokenLogprob) -> list[tuple[int, float]]:
    return sorted(entry.top.items(), key=lambda kv: -kv[1])


def chat_content(ids: Sequence[int], entries: Sequence[TokenLogprob], render: TokenRenderer,
                 top_k: int) -> list[dict[str, Any]]:
    """Chat `logprobs.content`: one entry per generated token, with `top_k` alternatives."""
    return [{**_chat_token(render(token_id), entry.logprob),
             "top_logprobs": [_chat_token(render(t), lp) for t, lp in _ranked(entry)[:top_k]]}
            for token_id, entry in zip(ids, entries)]


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def prompt_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None,
                    render: TokenRenderer, top_k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing predicts it),
    else {token id (a string): {"logprob", "rank", "decoded_token"}} of the prompt token and its
    `top_k` alternatives. `rank` is the token's place among the alternatives (1 = the model's
    first choice), null for a prompt token outside them (its rank is not computed)."""
    out: list[dict[str, Any] | None] = []
    for token_id, entry in zip(ids, entries or [None] * len(ids)):
        if entry is None:
            out.append(None)
            continue
        ranked = _ranked(entry)
        rank = next((r for r, (t, _) in enumerate(ranked, 1) if t == token_id), None)
        tokens = {str(token_id): _vllm_logprob(entry.logprob, rank, render(token_id))}
        for r, (t, lp) in enumerate(ranked[:top_k], 1):
            tokens.setdefault(str(t), _vllm_logprob(lp, r, render(t)))
        out.append(tokens)
    return out


def _vllm_logprob(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": text}
