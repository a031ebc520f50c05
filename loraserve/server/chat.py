"""POST /v1/chat/completions: the tokenizer's chat template, chat logprobs, tool calls, SSE
chunks. Tools go through the chat template; `tool_calls.plan_tools` decides whether the answer
is constrained (a forced call) and whether it is parsed for calls (`auto`), per family."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import TemplateError
from starlette.responses import Response

from loraserve.engine.types import RequestOutput
from loraserve.server import serving as sv
from loraserve.server.endpoint import Endpoint, Plan, serve
from loraserve.server.config import ServerConfig
from loraserve.server.errors import APIError, clip
from loraserve.server.logprobs import TokenRenderer, chat_content, prompt_logprobs
from loraserve.server.protocol import ChatCompletionRequest, ChatMessage
from loraserve.server.tool_calls import (ToolPlan, ToolStream, check_parser, new_call_id, parse,
                                         plan_tools, tool_call_json)


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


# the chat template's own variables: each has its request field
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")


def template_variables(kwargs: Any) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`, checked: variables the chat template reads beside the
    messages (Qwen3's `enable_thinking`, ...); not one that a field of its own sets."""
    if kwargs is None:
        return {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise APIError(400, f"chat_template_kwargs.{key}: the request's own `{key}` field "
                           "sets it", param=f"chat_template_kwargs.{key}")
    return dict(kwargs)


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`messages` with `text` at the end of their system message (a new first one if none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def chat_prompt(req: Any, tokenizer: Any, max_model_len: int | None = None,
                tools: list[dict[str, Any]] | None = None, system: str | None = None) -> sv.Prompt:
    """The templated prompt (`tools` rendered by the template when given, `system` added to
    the system message, the request's `chat_template_kwargs` as the template's variables); a
    template that rejects the conversation is the client's 400. With `max_model_len`, a text
    too long for the context is refused before it is tokenized."""
    messages = message_dicts(req.messages)
    if system is not None:
        messages = with_system(messages, system)
    extra = {} if tools is None else {"tools": tools}  # a request without tools passes none
    variables = template_variables(getattr(req, "chat_template_kwargs", None))
    if variables:
        extra["variables"] = variables
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=req.add_generation_prompt,
                                             **extra)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"messages do not fit the chat template: {clip(exc)}",
                       param="messages") from exc
    if max_model_len is not None:
        sv.check_text_length(text, max_model_len, "messages")
    return sv.Prompt(text, tokenizer.encode(text))


@dataclass(slots=True)
class ChatChoice:
    """One choice's state: turns engine deltas into message text, tool calls and chat logprobs."""

    index: int
    render: TokenRenderer
    top_k: int | None  # None = logprobs off
    tools: ToolPlan | None = None  # parsed for tool calls when tools.family is set
    prompt: sv.Prompt | None = None
    prompt_k: int | None = None  # vLLM's prompt_logprobs (None: off)
    prompt_entries: list | None = None
    text: list[str] = field(default_factory=list)
    content: list[dict[str, Any]] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stream: ToolStream | None = None

    def __post_init__(self) -> None:
        if self.tools is not None and self.tools.family is not None:
            self.stream = ToolStream(self.tools.family, self.tools.max_calls)

    def apply(self, out: RequestOutput) -> list[dict[str, Any]] | None:
        """Account `out`; returns its logprobs content entries (None when off)."""
        if out.prompt_logprobs is not None:
            self.prompt_entries = out.prompt_logprobs
        self.text.append(out.text)
        self.num_tokens += len(out.token_ids)
        self.finish_reason = out.finish_reason or self.finish_reason
        if self.top_k is None:
            return None
        piece = chat_content(out.token_ids, out.logprobs or [], self.render, self.top_k)
        self.content += piece
        return piece

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        """Account `out`; returns its streamed choice entry (content and tool-call deltas)."""
        piece = self.apply(out)
        if self.stream is None:
            fields = {"content": out.text} if out.text else {}
        else:
            fields = self.stream.feed(out.text, final=out.finish_reason is not None,
                                      cut=out.finish_reason == "length")
        return {"index": self.index, "delta": fields,
                "logprobs": {"content": piece} if piece is not None else None,
                "finish_reason": _finish(out.finish_reason,
                                         self.stream is not None and self.stream.called)}

    def opening(self) -> dict[str, Any]:
        """The role entry each choice's stream starts with."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def to_json(self) -> dict[str, Any]:
        text = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = []
        if self.tools is not None and self.tools.family is not None:
            message["content"], calls = parse(self.tools.family, text, self.tools.max_calls,
                                              cut=self.finish_reason == "length")
        if calls:
            message["tool_calls"] = [tool_call_json(c, new_call_id()) for c in calls]
        return {"index": self.index, "message": message,
                "logprobs": {"content": self.content} if self.top_k is not None else None,
                "finish_reason": _finish(self.finish_reason, bool(calls))}


    def prompt_logprobs(self) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs` of the prompt (chat: the body's, beside its choices)."""
        return prompt_logprobs(self.prompt.token_ids, self.prompt_entries, self.render,
                               self.prompt_k or 0)


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: an answer that ended with tool calls ends `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason


def _logprobs_k(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _plan(req: ChatCompletionRequest, engine: sv.Engine,
          config: ServerConfig | None = None) -> Plan:
    """The templated prompt (checked), tools and sampling; max_tokens defaults to the room left.
    `config.tool_call_parser` (serve --tool-call-parser) names the tool-call format."""
    top_k = _logprobs_k(req)
    parser = check_parser(config.tool_call_parser) if config is not None else None
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                       engine.tokenizer.chat_template, parser, defer=True)
    prompt = chat_prompt(req, engine.tokenizer, engine.max_model_len,
                         None if tools is None else tools.tools,
                         None if tools is None else tools.system)
    max_tokens = req.requested_max_tokens()
    if max_tokens is None:  # vLLM: whatever room the context leaves
        max_tokens = max(engine.max_model_len - len(prompt.token_ids), 1)
    sv.check_max_tokens(max_tokens, minimum=1)
    sv.check_prompt(prompt, max_tokens, engine, "messages")
    params = sv.sampling_params(req, max_tokens, top_k)
    grammar = params.structured
    if tools is not None and tools.spec is not None:  # a forced call: its grammar
        if params.structured is not None:
            raise APIError(400, f"tool_choice: a forced tool call and {params.structured.param} "
                           "both constrain the answer; give one", param="tool_choice")
        grammar = tools.spec  # built off the event loop (endpoint.serve: GrammarChecks)

    def new_choice(index: int, prompt: sv.Prompt, render: TokenRenderer) -> ChatChoice:
        return ChatChoice(index, render, top_k, tools, prompt, req.prompt_logprobs)

    return Plan([prompt], params, new_choice, grammar)


def _tail(choices: Sequence[ChatChoice]) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` of a chat body: the prompt's, once (every choice shares it)."""
    if not choices or choices[0].prompt_k is None:
        return {}
    return {"prompt_logprobs": choices[0].prompt_logprobs()}


def _head(request_id: str, created: int, model: str, chunk: bool) -> dict[str, Any]:
    """The fields a chat body (`chat.completion`) or chunk (`chat.completion.chunk`) starts with."""
    return {"id": request_id, "created": created, "model": model,
            "object": "chat.completion.chunk" if chunk else "chat.completion"}


CHAT_COMPLETIONS = Endpoint("chatcmpl", _plan, _head, _tail)


async def create_chat_completion(req: ChatCompletionRequest, ctx: sv.ServerContext, principal: Any) -> Response:
    """Validate, template, fan out to the engine, answer as JSON or as an SSE stream."""
    return await serve(req, ctx, CHAT_COMPLETIONS, principal)
