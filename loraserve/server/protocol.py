"""Request bodies of the OpenAI-compatible endpoints (pydantic), as clients send them.

Fields OpenAI defines but loraserve does not implement are declared so that a non-default value
is a clear 400 rather than silently ignored; unknown extra fields are ignored, as OpenAI does.
vLLM extensions kept: `top_k`, `stop_token_ids`, `ignore_eos`, `return_tokens_as_token_ids`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, ValidationError, ValidatorFunctionWrapHandler,
                      field_validator)

PromptInput = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields both endpoints share. Range checks are SamplingParams' (engine types)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> str | None:
        """The name of a set field the engine cannot honour, if any."""
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_form(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> PromptInput:
        """One clear message instead of one per union member."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, a list of token ids "
                             "or a list of lists of token ids") from None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

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
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (new name) wins over `max_tokens` (deprecated name)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
