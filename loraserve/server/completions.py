"""POST /v1/completions: prompts as str | [str] | [int] | [[int]], echo, legacy logprobs, SSE."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from loraserve.engine.types import RequestOutput
from loraserve.server.errors import APIError, sse_error
from loraserve.server.logprobs import LegacyLogprobs, TokenRenderer
from loraserve.server.protocol import CompletionRequest
from loraserve.server import serving as sv
from loraserve.server.streaming import DONE, PrimedStream, collect, merge, sse, start_all


def normalize_prompts(prompt: Any, tokenizer: Any, vocab_size: int,
                      echo: bool) -> list[sv.Prompt]:
    """The four prompt forms as a list of Prompt (a [int] is one prompt, a [str] many).

    Token-id prompts are range-checked before anything decodes them; their text (only the echo
    needs it) is decoded only when echoing.
    """
    if isinstance(prompt, str):
        return [sv.Prompt(prompt, tokenizer.encode(prompt))]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], str):
        return [sv.Prompt(p, tokenizer.encode(p)) for p in prompt]
    id_lists = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in id_lists:
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

    def apply(self, out: RequestOutput) -> tuple[str, LegacyLogprobs | None]:
        """Account `out`; returns the text and logprobs it adds (the echo goes first)."""
        text = out.text
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

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "text": "".join(self.text),
                "logprobs": self.logprobs.to_json() if self.logprobs else None,
                "finish_reason": self.finish_reason}


def _concat(acc: LegacyLogprobs | None, piece: LegacyLogprobs) -> LegacyLogprobs:
    if acc is None:
        return piece
    acc.tokens += piece.tokens
    acc.token_logprobs += piece.token_logprobs
    acc.top_logprobs += piece.top_logprobs
    acc.text_offset += piece.text_offset
    return acc


async def create_completion(req: CompletionRequest, ctx: sv.ServerContext) -> Response:
    """Validate, fan out to the engine, answer as JSON or as an SSE stream."""
    clock = sv.RequestClock(ctx.metrics)
    engine = ctx.engine
    sv.reject_unsupported(req.unsupported())
    adapter = sv.resolve_adapter(req.model, engine)
    sv.check_n(req.n, ctx.max_n)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    sv.check_max_tokens(max_tokens)
    sv.check_stop_token_ids(req.stop_token_ids, engine.vocab_size)
    prompts = normalize_prompts(req.prompt, engine.tokenizer, engine.vocab_size, req.echo)
    for prompt in prompts:
        sv.check_prompt(prompt, max_tokens, engine, "prompt")
    params = sv.sampling_params(req, max_tokens, req.logprobs,
                                req.logprobs if req.echo and req.logprobs is not None else None)
    request_id = sv.new_id("cmpl")
    streams = await start_all(engine, sv.fan_out(request_id, prompts, req.n, params, adapter,
                                                 bool(req.stream)))
    clock.first_output()
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    ctx.metrics.prompt_tokens.inc(prompt_tokens)
    render = TokenRenderer(engine.tokenizer, req.return_tokens_as_token_ids)
    choices = [CompletionChoice(i, prompts[i // req.n], req.echo, req.logprobs, render)
               for i in range(len(streams))]
    head = {"id": request_id, "object": "text_completion", "created": sv.now(), "model": req.model}
    if req.stream:
        body = _stream(head, streams, choices, prompt_tokens, req.include_usage(), ctx, clock)
        return StreamingResponse(body, media_type="text/event-stream")
    await collect(streams, choices, ctx.metrics, clock)
    completion_tokens = sum(c.num_tokens for c in choices)
    return JSONResponse({**head, "choices": [c.to_json() for c in choices],
                         "usage": sv.usage(prompt_tokens, completion_tokens)})


async def _stream(head: dict[str, Any], streams: list[PrimedStream],
                  choices: list[CompletionChoice], prompt_tokens: int, include_usage: bool,
                  ctx: sv.ServerContext, clock: sv.RequestClock) -> AsyncIterator[str]:
    """SSE chunks, one per engine delta; then usage (if asked) and [DONE]."""
    try:
        async for index, out in merge(streams):
            text, piece = choices[index].apply(out)
            ctx.metrics.generation_tokens.inc(len(out.token_ids))
            choice = {"index": index, "text": text,
                      "logprobs": piece.to_json() if piece else None,
                      "finish_reason": out.finish_reason}
            yield sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            total = sum(c.num_tokens for c in choices)
            yield sse({**head, "choices": [], "usage": sv.usage(prompt_tokens, total)})
    except Exception as exc:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(exc)
    finally:
        clock.finished()
    yield DONE
