"""vLLM's utility routes: POST /tokenize and POST /detokenize, in vLLM's request and response shapes.

    POST /tokenize   {"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}
                  or {"model"?, "messages", "add_generation_prompt"?, "add_special_tokens"?,
                      "return_token_strs"?}
                  -> {"count", "max_model_len", "tokens", "token_strs"?}
    POST /detokenize {"model"?, "tokens"} -> {"prompt"}

`model` (default: the base) is resolved as a generation request's is (`serving.resolve_model`):
a name the key may not see, or that names nothing, is the same 404, so these routes reveal no
more than generation does. The ids are exactly those a generation request for the same input
sends to the engine: the prompt as /v1/completions tokenizes it, the messages through the chat
template as /v1/chat/completions renders them (`chat.chat_prompt`, `tools` and
`chat_template_kwargs` included, checked by the chat endpoint's rules: `tool_calls.plan_tools`).
The served base's tokenizer and template serve every adapter of it (an adapter carries no
tokenizer of its own), so the model is resolved for its answer, not for a different tokenizer.

Fields are held to the API's rule (docs/API_FIELDS.md): a field no body declares is a 400
`unknown_parameter`, and vLLM's fields the server does not honour are a 400
`unsupported_parameter` naming them.
"""
from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from fastapi import APIRouter, Request

from loraserve.server import serving as sv
from loraserve.server.chat import chat_prompt
from loraserve.server.completions import normalize_prompts
from loraserve.server.errors import APIError
from loraserve.server.protocol import ChatMessage, JSONBodyRoute, Refused, StrictBody, _refused_field
from loraserve.server.request_log import RequestRecord, current_record
from loraserve.server.tenancy import principal_of
from loraserve.server.tool_calls import plan_tools

# add_special_tokens: as vLLM's, a `prompt` is tokenized as /v1/completions tokenizes it (the
# tokenizer's special tokens, e.g. a BOS, added unless false) and `messages` as the chat route
# does (the template writes its own; true is refused: the chat route has no such switch)
CHAT_SPECIALS = Refused("messages are tokenized as /v1/chat/completions tokenizes them: the chat "
                        "template writes every special token; only false", lambda v: v is False)


class TokenizeRequest(StrictBody):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), one body:
    exactly one of the two is given."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Any = None  # checked as chat's (tool_calls.plan_tools)
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables, as chat's
    add_special_tokens: bool | None = None  # None: vLLM's default for the form (prompt true, messages false)
    # refused (REFUSED): declared so that the 400 says why
    continue_final_message: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    REFUSED: ClassVar[dict[str, Refused]] = {
        "continue_final_message": Refused("the template always ends the conversation where the "
                                          "chat endpoint does; only false", lambda v: v is False),
        "chat_template": Refused("the served base's chat template is the only one"),
        "mm_processor_kwargs": Refused("the served models take text only"),
    }

    def unsupported(self) -> tuple[str, str] | None:
        return _refused_field(self, self.REFUSED)


class DetokenizeRequest(StrictBody):
    """vLLM's DetokenizeRequest."""

    model: str | None = None
    tokens: list[int]


def _input(req: TokenizeRequest, engine: sv.Engine) -> list[int]:
    """The token ids a generation request with this input would send to the engine."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of `prompt` (as /v1/completions takes it) or "
                       "`messages` (as /v1/chat/completions takes them)",
                       param="prompt" if req.prompt is None else "messages")
    if req.prompt is not None:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(req, name):
                raise APIError(400, f"{name} go to the chat template: send `messages`",
                               param=name)
        specials = True if req.add_special_tokens is None else req.add_special_tokens
        return normalize_prompts(req.prompt, engine.tokenizer, engine.vocab_size, False,
                                 engine.max_model_len, specials)[0].token_ids
    if req.add_special_tokens:
        raise APIError(400, f"add_special_tokens: {CHAT_SPECIALS.reason}", code="unsupported_parameter",
                       param="add_special_tokens")
    tools = plan_tools(req.tools, None, None, engine.tokenizer.chat_template)
    return chat_prompt(req, engine.tokenizer, engine.max_model_len,
                       None if tools is None else tools.tools).token_ids


def tokenize(req: TokenizeRequest, engine: sv.Engine) -> dict[str, Any]:
    """The /tokenize answer for a checked request (blocking: tokenizer work)."""
    ids = _input(req, engine)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len,
                           "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [engine.tokenizer.token_text(t) for t in ids]
    return out


def detokenize(req: DetokenizeRequest, engine: sv.Engine) -> dict[str, Any]:
    """The /detokenize answer: the ids' text, special tokens included (vLLM's), ids checked."""
    sv.check_token_ids(req.tokens, engine.vocab_size, "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


async def _resolved_engine(model: str | None, request: Request) -> sv.Engine:
    """The engine, once `model` (None: the base) resolves for the caller: the 404 of
    generation for a name it may not see or that names nothing."""
    ctx: sv.ServerContext = request.app.state.ctx
    record = current_record() or RequestRecord("")  # the request's log line
    record.model = model
    if model is not None:
        resolved = await sv.resolve_model(model, principal_of(request), ctx.engine)
        record.adapter, record.tenant = resolved.ref, resolved.tenant or None
    return ctx.engine


def tokenize_router() -> APIRouter:
    """POST /tokenize and POST /detokenize (vLLM's paths, outside /v1)."""
    router = APIRouter(route_class=JSONBodyRoute)

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        sv.reject_unsupported(body.unsupported())
        engine = await _resolved_engine(body.model, request)
        return await asyncio.to_thread(tokenize, body, engine)  # a long text: off the loop

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        engine = await _resolved_engine(body.model, request)
        return await asyncio.to_thread(detokenize, body, engine)

    return router
