"""POST /v1/chat/completions: the tokenizer's chat template, chat logprobs, SSE chunks."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import TemplateError
from starlette.responses import JSONResponse, Response, StreamingResponse

from loraserve.engine.types import RequestOutput
from loraserve.server import serving as sv
from loraserve.server.errors import APIError, sse_error
from loraserve.server.logprobs import TokenRenderer, chat_content
from loraserve.server.protocol import ChatCompletionRequest, ChatMessage
from loraserve.server.streaming import DONE, PrimedStream, collect, merge, sse, start_all


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them; content parts must be text."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, "only text content parts are supported",
                               param=f"messages.{i}.content")
            content = "".join(str(part.get("text", "")) for part in content)
        d = {**(m.model_extra or {}), "role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> sv.Prompt:
    """The templated prompt; a template that rejects the conversation is the client's 400."""
    messages = message_dicts(req.messages)
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=req.add_generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"messages do not fit the chat template: {exc}",
                       param="messages") from exc
    return sv.Prompt(text, tokenizer.encode(text))


@dataclass(slots=True)
class ChatChoice:
    """One choice's state: turns engine deltas into message text and chat logprobs."""

    index: int
    render: TokenRenderer
    top_k: int | None  # None = logprobs off
    text: list[str] = field(default_factory=list)
    content: list[dict[str, Any]] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None

    def apply(self, out: RequestOutput) -> list[dict[str, Any]] | None:
        """Account `out`; returns its logprobs content entries (None when off)."""
        self.text.append(out.text)
        self.num_tokens += len(out.token_ids)
        self.finish_reason = out.finish_reason or self.finish_reason
        if self.top_k is None:
            return None
        piece = chat_content(out.token_ids, out.logprobs or [], self.render, self.top_k)
        self.content += piece
        return piece

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index,
                "message": {"role": "assistant", "content": "".join(self.text)},
                "logprobs": {"content": self.content} if self.top_k is not None else None,
                "finish_reason": self.finish_reason}


def _logprobs_k(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def create_chat_completion(req: ChatCompletionRequest, ctx: sv.ServerContext) -> Response:
    """Validate, template, fan out to the engine, answer as JSON or as an SSE stream."""
    clock = sv.RequestClock(ctx.metrics)
    engine = ctx.engine
    sv.reject_unsupported(req.unsupported())
    adapter = sv.resolve_adapter(req.model, engine)
    sv.check_n(req.n, ctx.max_n)
    sv.check_stop_token_ids(req.stop_token_ids, engine.vocab_size)
    top_k = _logprobs_k(req)
    prompt = chat_prompt(req, engine.tokenizer)
    max_tokens = req.requested_max_tokens()
    if max_tokens is None:  # vLLM: whatever room the context leaves
        max_tokens = max(engine.max_model_len - len(prompt.token_ids), 1)
    sv.check_max_tokens(max_tokens, minimum=1)
    sv.check_prompt(prompt, max_tokens, engine, "messages")
    params = sv.sampling_params(req, max_tokens, top_k)
    request_id = sv.new_id("chatcmpl")
    streams = await start_all(engine, sv.fan_out(request_id, [prompt], req.n, params, adapter,
                                                 bool(req.stream)))
    clock.first_output()
    ctx.metrics.prompt_tokens.inc(len(prompt.token_ids))
    render = TokenRenderer(engine.tokenizer, req.return_tokens_as_token_ids)
    choices = [ChatChoice(i, render, top_k) for i in range(len(streams))]
    head = {"id": request_id, "created": sv.now(), "model": req.model}
    n_prompt = len(prompt.token_ids)
    if req.stream:
        body = _stream(head, streams, choices, n_prompt, req.include_usage(), ctx, clock)
        return StreamingResponse(body, media_type="text/event-stream")
    await collect(streams, choices, ctx.metrics, clock)
    return JSONResponse({**head, "object": "chat.completion",
                         "choices": [c.to_json() for c in choices],
                         "usage": sv.usage(n_prompt, sum(c.num_tokens for c in choices))})


async def _stream(head: dict[str, Any], streams: list[PrimedStream], choices: list[ChatChoice],
                  prompt_tokens: int, include_usage: bool, ctx: sv.ServerContext,
                  clock: sv.RequestClock) -> AsyncIterator[str]:
    """A role chunk per choice, one chunk per engine delta, usage (if asked), [DONE]."""
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    try:
        for c in choices:
            role = {"index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [role], **extra})
        async for index, out in merge(streams):
            piece = choices[index].apply(out)
            ctx.metrics.generation_tokens.inc(len(out.token_ids))
            choice = {"index": index, "delta": {"content": out.text} if out.text else {},
                      "logprobs": {"content": piece} if piece is not None else None,
                      "finish_reason": out.finish_reason}
            yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            total = sum(c.num_tokens for c in choices)
            yield sse({**head, "choices": [], "usage": sv.usage(prompt_tokens, total)})
    except Exception as exc:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(exc)
    finally:
        clock.finished()
    yield DONE
