"""A deterministic stand-in for loraserve.engine.AsyncEngine (same facade), for server tests.

Tokens are printable ASCII characters (id = ord(c) - 32), so text and ids map one to one.
Generated token k of a request is a pure function of (prompt, seed, adapter, k); logprobs are
fixed functions of k. Requests, aborts and lifecycle calls are recorded for assertions.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from loraserve.catalog.errors import CatalogError

from loraserve.catalog.errors import InvalidAdapterId
from loraserve.catalog.ids import parse_model_ref
from loraserve.engine.directory import not_found
from loraserve.engine.types import EngineError, GenerateRequest, RequestOutput, ResolvedModel, TokenLogprob

EOS_ID = 95
NEWLINE_ID = 96
VOCAB_SIZE = 100


class FakeCatalogError(CatalogError):
    """A CatalogError with the status given per instance (404 unknown, 409 mismatch)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class FakeTokenizer:
    """One token per printable ASCII char; 95 = <eos>, 96 = newline, 97..99 unused specials."""

    vocab_size = VOCAB_SIZE
    eos_token_ids = [EOS_ID]
    chat_template = None  # renders no tools: a request with tools is refused

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [NEWLINE_ID if c == "\n" else (ord(c) - 32 if 32 <= ord(c) < 127 else 31)
                for c in text]

    def token_text(self, token_id: int) -> str:
        if token_id < 95:
            return chr(token_id + 32)
        return "\n" if token_id == NEWLINE_ID else f"<special{token_id}>"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.token_text(t) for t in ids if t != EOS_ID or not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            variables: dict | None = None) -> str:
        """role: content lines; `variables` (chat_template_kwargs) as a first `k=v` line."""
        if messages[0]["role"] == "tool":
            raise ValueError("a conversation cannot start with a tool message")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        head = " ".join(f"{k}={v}" for k, v in (variables or {}).items())
        return (f"{head}\n" if head else "") + text + ("assistant:" if add_generation_prompt else "")


@dataclass
class FakeEngine:
    model_name: str = "fake-base"
    max_model_len: int = 64
    vocab_size: int = VOCAB_SIZE
    delay_s: float = 0.0
    adapters: tuple[str, ...] = ("acme/support",)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    fail_next: BaseException | None = None   # raised before the first delta
    fail_mid_stream: BaseException | None = None  # raised after the first delta
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: int = 0
    started: bool = False
    shut_down: bool = False
    config: Any = None  # an EngineConfig, where a test needs one (tinker: tokenizer_name)

    # the optional parts of engine/interface.py's EngineInterface: "not here" for this fake
    catalog = None
    sourcing = None
    ready = True
    snapshot = None
    core_pid = None
    trainer = None

    def unavailable(self) -> EngineError:
        return EngineError("the fake engine is not ready", status=503, code="engine_unavailable")

    def supervision(self) -> None:
        return None

    def replica_snapshots(self) -> None:
        return None

    def describe_adapter(self, adapter_id: str) -> dict:
        raise EngineError(f"adapter {adapter_id} not found", status=404, code="model_not_found")

    async def unload_adapter(self, adapter_id: str) -> int:
        raise EngineError(f"adapter {adapter_id} not found", status=404, code="model_not_found")

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True

    def stats(self) -> dict:
        return {"running": self.running, "waiting": 2, "parked": 0, "batch_size": self.running,
                "kv_usage": 0.25}

    def list_models(self) -> list[str]:
        return [self.model_name, *self.adapters]

    async def resolve(self, model: str, principal) -> ResolvedModel:
        """The fake's AdapterDirectory: the base and `adapters` (as `tenant/name` or `@r1`, with
        or without `tinker://`); a name that is no valid id, names no adapter or one of a tenant
        `principal` may not see is the one 404; `acme/mismatch` is a 409 (another base)."""
        self._check_fail()
        name = model.removeprefix("tinker://")
        if name == self.model_name:
            return ResolvedModel(model, name, tenant=principal.home_tenant)
        try:
            adapter_id, rev = parse_model_ref(name)
        except InvalidAdapterId:
            raise not_found(model) from None
        tenant = adapter_id.split("/", 1)[0]
        if not principal.sees(tenant):
            raise not_found(model)
        if adapter_id == "acme/mismatch":
            raise FakeCatalogError(f"{name} was exported against another base", 409)
        if adapter_id not in self.adapters or rev not in (None, "r1"):
            raise not_found(model)
        return ResolvedModel(model, name, (adapter_id, rev or "r1"), None, tenant)

    def _check_fail(self) -> None:
        """`fail_next` set to a 404/409-style catalog error fails the lookup (as a real catalog would)."""
        if isinstance(self.fail_next, CatalogError):
            error, self.fail_next = self.fail_next, None
            raise error

    def _check(self, request: GenerateRequest) -> None:
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        ref = request.adapter
        if ref is not None:
            adapter_id, _, rev = ref.partition("@")
            if adapter_id == "acme/mismatch":
                raise FakeCatalogError(f"{ref} was exported against another base", 409)
            if adapter_id not in self.adapters or rev not in ("", "r1"):
                raise FakeCatalogError(f"adapter {ref} not found", 404)

    def token_at(self, request: GenerateRequest, k: int) -> int:
        base = sum(request.prompt_token_ids) + 7 * k + (request.params.seed or 0)
        base += 3 if request.adapter else 0
        return 33 + base % 26  # 'A'..'Z'

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._check(request)
        self.requests.append(request)
        self.running += 1
        finished = False
        try:
            async for out in self._deltas(request):
                finished = out.finish_reason is not None
                yield out
                if self.fail_mid_stream is not None:
                    error, self.fail_mid_stream = self.fail_mid_stream, None
                    finished = True
                    raise error
        finally:
            self.running -= 1
            if not finished:
                self.aborted.append(request.request_id)

    async def _deltas(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        params, text = request.params, ""
        first = _prompt_logprobs(request)
        if params.max_tokens == 0:
            yield self._out(request, [], "", "length", 0, first)
            return
        for k in range(params.max_tokens):
            await asyncio.sleep(self.delay_s)
            token = self.token_at(request, k)
            piece = self.tokenizer.token_text(token)
            text += piece
            stopped = any(text.endswith(s) for s in params.stop)
            reason = "stop" if stopped else ("length" if k + 1 == params.max_tokens else None)
            yield self._out(request, [token], "" if stopped else piece, reason, k + 1,
                            first if k == 0 else None, k)
            if reason:
                return

    def _out(self, request: GenerateRequest, ids: list[int], text: str, reason: str | None,
             count: int, prompt_lps: list | None, k: int = 0) -> RequestOutput:
        n_top = request.params.logprobs
        lps = None if n_top is None else [_logprob(t, -0.5 - 0.01 * k, n_top) for t in ids]
        return RequestOutput(request_id=request.request_id, token_ids=ids, text=text,
                             logprobs=lps, prompt_logprobs=prompt_lps, finish_reason=reason,
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_output_tokens=count)


def _logprob(token: int, lp: float, n_top: int) -> TokenLogprob:
    top = {(token + j) % 95: lp - j for j in range(max(n_top, 1))}
    return TokenLogprob(token_id=token, logprob=lp, top=top)


def _prompt_logprobs(request: GenerateRequest) -> list[TokenLogprob | None] | None:
    n_top = request.params.prompt_logprobs
    if n_top is None:
        return None
    ids = request.prompt_token_ids
    return [None] + [_logprob(t, -1.0 - 0.1 * i, n_top) for i, t in enumerate(ids[1:])]
