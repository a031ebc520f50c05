"""Request bodies of the OpenAI-compatible endpoints (pydantic), as clients send them.

Every field a client sends is honoured or refused, never ignored (docs/API_FIELDS.md lists
them all):

- a field the body model does not declare is a 400 `unknown_parameter` naming it (OpenAI
  answers unknown parameters with a 400 too), nested ones (`stream_options.x`) included;
- a field OpenAI or vLLM defines that loraserve does not implement is declared in the model's
  `REFUSED` table: a value other than null or the one that asks for what the server does anyway
  (`response_format` {"type": "text"}, `tool_choice` "none", `store` false, ...) is a 400
  `unsupported_parameter` naming it and saying why (`unsupported()`, checked by
  serving.check_request);
- `null` for a declared field means "not given" (the openai client sends null for an explicit
  None), so it takes the default.

Structured output (`response_format` json_object / json_schema, vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`) is read and checked by
`serving.structured_spec` (at most one per request; a grammar that does not parse is a 400
naming its field). vLLM extensions honoured: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `return_tokens_as_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `prompt_logprobs`, (chat) `add_generation_prompt`,
`chat_template_kwargs`.
Tool calling (chat `tools`, `tool_choice`, `parallel_tool_calls`) is read and checked by
`tool_calls.plan_tools`.
OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias` are honoured as OpenAI defines
them. End-user identifiers (`user`; on chat also `safety_identifier`, `prompt_cache_key`,
`metadata`) are accepted and logged (`identifiers()`, logger `loraserve.server.requests`).

Bodies are read by `JSONBodyRoute`: strict JSON (no NaN/Infinity, no lone surrogates: a 400
naming the field), parsed and validated on a worker thread when large, and checked against the
server's InputLimits (the validation context) before any per-item work: a prompt or message list
that cannot fit is refused on its length alone.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import (BaseModel, ConfigDict, ValidationError, ValidationInfo,
                      ValidatorFunctionWrapHandler, field_validator, model_validator)
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import Response

from loraserve.engine.types import DEFAULT_MAX_TOKENS
from loraserve.server.errors import APIError, BodyError, validation_error

PromptInput = str | list[str] | list[int] | list[list[int]]

# A token is at most this many characters on average: a longer text cannot fit the context and is
# refused on its length, before tokenizing.
CHARS_PER_TOKEN_MAX = 16


def too_long_message(max_model_len: int, size: int, unit: str) -> str:
    """Why an input of `size` tokens or characters (`unit`) cannot fit the context."""
    text = "" if unit == "tokens" else \
        f", at most {max_model_len * CHARS_PER_TOKEN_MAX} characters of text"
    return (f"This model's maximum context length is {max_model_len} tokens{text}; "
            f"the input has {size} {unit}.")


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Bounds a request's input is checked against before it is tokenized or even validated."""

    max_model_len: int
    max_seqs: int

    @property
    def max_chars(self) -> int:
        return self.max_model_len * CHARS_PER_TOKEN_MAX


def _limits(info: ValidationInfo) -> InputLimits | None:
    return (info.context or {}).get("limits")


def _too_long(limits: InputLimits, size: int, unit: str) -> PydanticCustomError:
    return PydanticCustomError("context_length_exceeded",
                               too_long_message(limits.max_model_len, size, unit))


@dataclass(frozen=True, slots=True)
class Refused:
    """A declared field the server does not implement: `reason` says why; `accepts(value)` is
    True for the values that ask for what the server does anyway (null always is)."""

    reason: str
    accepts: Callable[[Any], bool] = lambda value: False


def _refused_field(model: BaseModel, refused: dict[str, Refused]) -> tuple[str, str] | None:
    """(name, reason) of the first field of `model` in `refused` set to a value it refuses."""
    for name, rule in refused.items():
        value = getattr(model, name)
        if value is not None and not rule.accepts(value):
            return name, rule.reason
    return None


class StrictBody(BaseModel):
    """A request body: undeclared fields are refused (parse_body: 400 `unknown_parameter`), and
    null for a declared field means "not given"."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(StrictBody):
    include_usage: bool = False
    include_obfuscation: bool | None = None

    REFUSED: ClassVar[dict[str, Refused]] = {
        "include_obfuscation": Refused("stream chunks carry no obfuscation padding; only false",
                                       lambda v: v is False)}


class SamplingFields(StrictBody):
    """Sampling fields both endpoints share. Range checks are SamplingParams' (engine types)."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output (serving.structured_spec reads and checks them: at most one)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # refused (REFUSED): declared so that the 400 says why
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    REFUSED: ClassVar[dict[str, Refused]] = {
        "guided_decoding_backend": Refused("one grammar backend (xgrammar); only \"xgrammar\" "
                                           "or \"auto\"", lambda v: v in ("xgrammar", "auto")),
        "guided_whitespace_pattern": Refused("the JSON grammars' whitespace is the server's"),
    }
    # accepted and logged (serving.check_request), never used otherwise
    IDENTIFIERS: ClassVar[tuple[str, ...]] = ("user",)

    def unsupported(self) -> tuple[str, str] | None:
        """(name, reason) of a set field the server does not honour, if any."""
        if self.prompt_logprobs is not None and self.stream:  # vLLM refuses it too
            return "prompt_logprobs", "not available with stream: true"
        if self.stream_options is not None:
            if not self.stream:
                return "stream_options", "only allowed when stream is true"
            found = _refused_field(self.stream_options, StreamOptions.REFUSED)
            if found is not None:
                return f"stream_options.{found[0]}", found[1]
        return _refused_field(self, self.REFUSED)

    def identifiers(self) -> dict[str, Any]:
        """The end-user identifiers and metadata the request carries (logged, not used)."""
        return {name: getattr(self, name) for name in self.IDENTIFIERS
                if getattr(self, name) is not None}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def num_prompts(self) -> int:
        """Prompts the request holds (each starts `n` sequences)."""
        return 1

    def input_size(self) -> int:
        """Characters and token ids of the input: what tokenizing it costs, roughly."""
        return 0


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (where it adds one) before a text prompt

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_form(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                     info: ValidationInfo) -> PromptInput:
        """Sizes first (the server's limits, from the context), then one clear message instead
        of one per union member."""
        limits = _limits(info)
        if limits is not None:
            _check_prompt_sizes(value, limits)
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, a list of token ids "
                             "or a list of lists of token ids") from None

    def num_prompts(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1

    def input_size(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, str) else sum(len(x) if isinstance(x, (str, list)) else 1
                                                     for x in p)

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "insertion (text after the completion) is not implemented"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "only equal to n: candidates are not ranked server-side"
        return super().unsupported()


def _check_prompt_sizes(value: Any, limits: InputLimits) -> None:
    """Lengths only, no per-item work: a list of more prompts than a request may start, a token
    id list longer than the context, a text longer than the context can hold in characters."""
    if isinstance(value, str):
        if len(value) > limits.max_chars:
            raise _too_long(limits, len(value), "characters")
        return
    if not isinstance(value, list) or not value:
        return
    if isinstance(value[0], int):
        if len(value) > limits.max_model_len:
            raise _too_long(limits, len(value), "tokens")
        return
    if len(value) > limits.max_seqs:
        raise PydanticCustomError("too_many_sequences",
                                  "{count} prompts; the server accepts at most {max_seqs} "
                                  "sequences (prompts x n) per request",
                                  {"count": len(value), "max_seqs": limits.max_seqs})
    for item in value:
        if isinstance(item, str) and len(item) > limits.max_chars:
            raise _too_long(limits, len(item), "characters")
        if isinstance(item, list) and len(item) > limits.max_model_len:
            raise _too_long(limits, len(item), "tokens")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    # tool calling (server/tool_calls.plan_tools reads and checks them)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # refused (REFUSED): declared so that the 400 says why
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    REFUSED: ClassVar[dict[str, Refused]] = {
        **SamplingFields.REFUSED,
        "functions": Refused("the deprecated functions API is not implemented; use tools",
                             lambda v: v == []),
        "function_call": Refused("the deprecated functions API is not implemented; use "
                                 "tool_choice; only \"none\"", lambda v: v == "none"),
        "audio": Refused("audio output is not implemented"),
        "modalities": Refused("text output only: only [\"text\"]", lambda v: v == ["text"]),
        "prediction": Refused("predicted outputs are not implemented"),
        "reasoning_effort": Refused("reasoning controls are not implemented"),
        "verbosity": Refused("verbosity controls are not implemented"),
        "web_search_options": Refused("web search is not implemented"),
        "store": Refused("completions are not stored; only false", lambda v: v is False),
        "service_tier": Refused("one service tier; only \"auto\" or \"default\"",
                                lambda v: v in ("auto", "default")),
        "moderation": Refused("moderation is not implemented"),
        "prompt_cache_retention": Refused("prefix caching is automatic and its retention the "
                                          "server's"),
        "prompt_cache_options": Refused("prefix caching is automatic"),
    }
    IDENTIFIERS: ClassVar[tuple[str, ...]] = ("user", "safety_identifier", "prompt_cache_key",
                                              "metadata")

    @field_validator("messages", mode="wrap")
    @classmethod
    def _messages_size(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                       info: ValidationInfo) -> list[ChatMessage]:
        """More messages than context tokens, or more text than the context can hold in
        characters, is refused before the messages are validated one by one."""
        limits = _limits(info)
        if limits is not None and isinstance(value, list):
            if len(value) > limits.max_model_len:
                raise PydanticCustomError(
                    "context_length_exceeded", "{count} messages cannot fit a context of "
                    "{max_model_len} tokens", {"count": len(value),
                                               "max_model_len": limits.max_model_len})
            chars = sum(_content_chars(m) for m in value)
            if chars > limits.max_chars:
                raise _too_long(limits, chars, "characters")
        return handler(value)

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
        if value is not None and (len(value) > 16 or any(len(k) > 64 for k in value)
                                  or any(len(v) > 512 for v in value.values())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters, values of at "
                             "most 512")
        return value

    def input_size(self) -> int:
        return sum(_content_chars(m) for m in self.messages)

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (new name) wins over `max_tokens` (deprecated name)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _content_chars(message: Any) -> int:
    """Characters of a message's content (a raw dict or a ChatMessage; text parts summed)."""
    content = message.get("content") if isinstance(message, dict) else \
        getattr(message, "content", None)
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text", "")) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


# -- reading a body -------------------------------------------------------------------------------

OFF_LOOP_BYTES = 64 * 1024  # bodies larger than this are parsed and validated on a worker thread
# a lone surrogate can only come from a \ud800-\udfff escape or raw surrogate bytes (json
# decodes UTF-8 with surrogatepass); other encodings (UTF-16/32) are always searched
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse_body(body: bytes, model: type[BaseModel], limits: InputLimits | None) -> BaseModel:
    """`body` as a validated `model`; BodyError (a 400 naming the field where it can) for
    malformed JSON, NaN/Infinity, lone surrogates, sizes over `limits`, invalid fields."""
    non_finite = False

    def parse_float(text: str) -> float:
        nonlocal non_finite
        value = float(text)
        non_finite = non_finite or not math.isfinite(value)  # 1e999 is inf
        return value

    def parse_constant(text: str) -> float:
        nonlocal non_finite
        non_finite = True
        return float(text)

    try:
        raw = json.loads(body, parse_float=parse_float, parse_constant=parse_constant)
    except json.JSONDecodeError as exc:
        raise BodyError(APIError(400, f"Malformed JSON body: {exc.msg}", code="invalid_json"))
    except (ValueError, RecursionError) as exc:  # bad encoding, huge int literal, deep nesting
        raise BodyError(APIError(400, f"Malformed JSON body: {type(exc).__name__}: {exc}",
                                 code="invalid_json")) from None
    surrogates = (_MAYBE_SURROGATE.search(body) is not None or not body[:4].isascii()
                  or b"\x00" in body[:4])
    if non_finite or surrogates:
        found = _find_bad_value(raw, non_finite, surrogates)
        if found is not None:
            param, what = found
            raise BodyError(APIError(400, f"{param or 'body'}: {what}", param=param or None))
    try:
        return model.model_validate(raw, context={"limits": limits})
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        unknown = next((e for e in errors if e.get("type") == "extra_forbidden"), None)
        if unknown is not None:  # what the body should not hold at all comes first
            raise BodyError(unknown_parameter(".".join(str(p) for p in unknown["loc"])))
        raise BodyError(validation_error(RequestValidationError(errors))) from None


def unknown_parameter(name: str) -> APIError:
    """The 400 for a field the body model does not declare (OpenAI's answer to one)."""
    return APIError(400, f"Unrecognized request argument supplied: {name!r}: this server "
                    "does not implement it (see docs/API_FIELDS.md)", param=name,
                    code="unknown_parameter")


def _find_bad_value(raw: Any, non_finite: bool, surrogates: bool) -> tuple[str, str] | None:
    """(dotted path, what is wrong) of the first NaN/Infinity or lone-surrogate string."""
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if surrogates and _has_surrogate(value):
                return path, "contains a lone UTF-16 surrogate, which is not valid Unicode text"
        elif isinstance(value, float):
            if non_finite and not math.isfinite(value):
                return path, "must be a finite number (NaN and Infinity are not valid JSON)"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                sub = f"{path}.{key}" if path else str(key)
                if surrogates and _has_surrogate(key):
                    return sub, "a key contains a lone UTF-16 surrogate"
                stack.append((sub, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item)
                         for i, item in reversed(list(enumerate(value))))
    return None


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


class _JSONBodyRequest(Request):
    """A Request whose `json()` is `parse_body` against the route's body model: what FastAPI
    then validates is already a model instance (kept as is)."""

    body_model: type[BaseModel]

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            ctx = getattr(self.app.state, "ctx", None)
            parse = partial(parse_body, body, self.body_model,
                            ctx.limits if ctx is not None else None)
            self._json = await asyncio.to_thread(parse) if len(body) > OFF_LOOP_BYTES else parse()
        return self._json


class JSONBodyRoute(APIRoute):
    """An APIRoute whose JSON body is read by `parse_body` (see the module doc)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self._body_model()
        if model is None:
            return handler

        async def route(request: Request) -> Response:
            wrapped = _JSONBodyRequest(request.scope, request.receive)
            wrapped.body_model = model
            return await handler(wrapped)

        return route

    def _body_model(self) -> type[BaseModel] | None:
        """The pydantic model of the route's one body parameter, if it has one."""
        params = self.dependant.body_params
        if len(params) != 1:
            return None
        annotation = getattr(params[0].field_info, "annotation", None)
        return annotation if isinstance(annotation, type) and \
            issubclass(annotation, BaseModel) else None
