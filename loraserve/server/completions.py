"""POST /v1/completions: prompts as str | [str] | [int] | [[int]], echo, legacy logprobs, SSE."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from loraserve.engine.types import DEFAULT_MAX_TOKENS, RequestOutput
from loraserve.server import serving as sv
from loraserve.server.endpoint import Endpoint, Plan, serve
from loraserve.server.errors import APIError
from loraserve.server.logprobs import LegacyLogprobs, TokenRenderer, prompt_logprobs
from loraserve.server.protocol import CompletionRequest


def normalize_prompts(prompt: Any, tokenizer: Any, vocab_size: int, echo: bool,
                      max_model_len: int | None = None, add_special_tokens: bool = True) -> list[sv.Prompt]:
    """The four prompt forms as a list of Prompt (a [int] is one prompt, a [str] many).

    A text is tokenized with the tokenizer's special tokens (a BOS where the model's tokenizer
    adds one), as vLLM's completions do unless the request says `add_special_tokens: false`;
    token ids are taken as given.

    With `max_model_len`, a text or id list that cannot fit the context is refused on its length, before
    it is tokenized or its ids checked. Token-id prompts are range-checked before anything decodes
    them; their text (only the echo needs it) is decoded only when echoing.
    """
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], str):
        for text in prompt if max_model_len is not None else ():
            sv.check_text_length(text, max_model_len, "prompt")
        return [sv.Prompt(p, tokenizer.encode(p, add_special_tokens=add_special_tokens)) for p in prompt]
    id_lists = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in id_lists:
        if max_model_len is not None:
            sv.check_ids_length(ids, max_model_len, "prompt")
        sv.check_token_ids(ids, vocab_size, "prompt")
    return [sv.Prompt(tokenizer.decode(ids) if echo else "", list(ids)) for ids in id_lists]


@dataclass(slots=True)
class CompletionChoice:
    """One choice's state: turns engine deltas into OpenAI text/logprobs pieces."""

    index: int
    prompt: sv.Prompt
    echo: bool
    top_k: int | None  # logprobs requested (top-k alternatives); None = no logprobs
    render: TokenRenderer
    offset: int = 0
    started: bool = False
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    prompt_k: int | None = None  # vLLM's prompt_logprobs (None: off)
    prompt_entries: list | None = None

    def apply(self, out: RequestOutput) -> tuple[str, LegacyLogprobs | None]:
        """Account `out`; returns the text and logprobs it adds (the echo goes first)."""
        text = out.text
        if out.prompt_logprobs is not None:
            self.prompt_entries = out.prompt_logprobs
        piece = LegacyLogprobs() if self.top_k is not None else None
        if not self.started:
            self.started = True
            if self.echo:
                text = self.prompt.text + text
                if piece is not None:
                    entries = out.prompt_logprobs or [None] * len(self.prompt.token_ids)
                    self.offset = piece.extend(self.prompt.token_ids, entries, self.render,
                                               self.offset, self.top_k)
        if piece is not None and out.logprobs:
            self.offset = piece.extend(out.token_ids, out.logprobs, self.render, self.offset,
                                       self.top_k)
        self.text.append(text)
        self.num_tokens += len(out.token_ids)
        self.finish_reason = out.finish_reason or self.finish_reason
        if piece is not None:
            self.logprobs = _concat(self.logprobs, piece)
        return text, piece

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        """Account `out`; returns its streamed choice entry."""
        text, piece = self.apply(out)
        return {"index": self.index, "text": text, "logprobs": piece.to_json() if piece else None,
                "finish_reason": out.finish_reason}

    def opening(self) -> None:
        """Completions stream no entry before the first delta."""
        return None

    def to_json(self) -> dict[str, Any]:
        body = {"index": self.index, "text": "".join(self.text),
                "logprobs": self.logprobs.to_json() if self.logprobs else None,
                "finish_reason": self.finish_reason}
        if self.prompt_k is not None:  # vLLM's, per choice
            body["prompt_logprobs"] = prompt_logprobs(self.prompt.token_ids, self.prompt_entries,
                                                      self.render, self.prompt_k)
        return body


def _concat(acc: LegacyLogprobs | None, piece: LegacyLogprobs) -> LegacyLogprobs:
    if acc is None:
        return piece
    acc.tokens += piece.tokens
    acc.token_logprobs += piece.token_logprobs
    acc.top_logprobs += piece.top_logprobs
    acc.text_offset += piece.text_offset
    return acc


def _plan(req: CompletionRequest, engine: sv.Engine, config: Any = None) -> Plan:
    """The prompts (each checked) and sampling; logprobs of the echoed prompt when asked."""
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sv.check_max_tokens(max_tokens)
    prompts = normalize_prompts(req.prompt, engine.tokenizer, engine.vocab_size, req.echo,
                                engine.max_model_len, req.add_special_tokens)
    for prompt in prompts:
        sv.check_prompt(prompt, max_tokens, engine, "prompt")
    params = sv.sampling_params(req, max_tokens, req.logprobs,
                                req.logprobs if req.echo and req.logprobs is not None else None)

    def new_choice(index: int, prompt: sv.Prompt, render: TokenRenderer) -> CompletionChoice:
        return CompletionChoice(index, prompt, req.echo, req.logprobs, render,
                                prompt_k=req.prompt_logprobs)

    return Plan(prompts, params, new_choice)


def _head(request_id: str, created: int, model: str, chunk: bool) -> dict[str, Any]:
    """The fields a completions body and each of its chunks start with (the same)."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model}


COMPLETIONS = Endpoint("cmpl", _plan, _head)


async def create_completion(req: CompletionRequest, ctx: sv.ServerContext, principal: Any) -> Response:
    """Validate, fan out to the engine, answer as JSON or as an SSE stream."""
    return await serve(req, ctx, COMPLETIONS, principal)
