"""One Tinker `asample`: its body, its engine requests, and the SampleResponse they make.

A SampleRequest samples `num_samples` sequences from one token prompt; sample i of a seeded
request uses seed + i (as /v1 does), so a seeded request is reproducible. Every sequence
carries the logprob of each sampled token (RL code reads them); `prompt_logprobs` and
`topk_prompt_logprobs` ask for the prompt's. `stop` is a string, strings, or token ids; the
tokens returned include the one that stopped the sequence, as the SDK's renderers expect.

A sequence the engine aborted has no SampleResponse shape (the SDK takes only "stop" and
"length"): the whole future fails with `{"error", "category": "server"}` instead.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from loraserve.engine.types import (EngineError, GenerateRequest, RequestOutput, ResolvedModel,
                                    SamplingParams)
from loraserve.server import serving as sv
from loraserve.server.errors import APIError, as_api_error
from loraserve.server.logprobs import finite
from loraserve.server.protocol import unknown_parameter
from loraserve.server.streaming import PrimedStream, merge, start_all

MAX_TOPK = 20          # the engine's bound on prompt logprob alternatives
CAPACITY_RETRY_S = 1.0  # a future the engine could not take yet is offered again after this


class Chunk(BaseModel):
    """One prompt chunk; only `encoded_text` (token ids) is served. Other kinds' fields are
    allowed here so that the 400 names the chunk kind (prompt_ids); an encoded_text chunk with
    any field besides `type` and `tokens` is refused there."""

    model_config = ConfigDict(extra="allow")

    type: str = "encoded_text"
    tokens: list[int] | None = None


class Prompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunks: list[Chunk]


class TinkerSamplingParams(BaseModel):
    """The SDK's SamplingParams (all of it: its models forbid extra fields, and so do these; an
    unknown field is a 400 `unknown_parameter` naming it, protocol.parse_body)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int | None = None  # None: up to the end of the context
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(BaseModel):
    """POST /api/v1/asample (the SDK's SampleRequest)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    prompt: Prompt
    sampling_params: TinkerSamplingParams
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = None
    model_path: str | None = None
    base_model: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    type: Literal["sample"] = "sample"


@dataclass(slots=True)
class SamplePlan:
    """A checked SampleBody: the prompt's token ids and the engine's sampling parameters."""

    prompt: sv.Prompt
    params: SamplingParams
    n: int
    want_prompt_logprobs: bool
    topk: int


def prompt_ids(prompt: Prompt) -> list[int]:
    """The token ids of the prompt's chunks, in order; 400 for a non-text chunk."""
    ids: list[int] = []
    for i, chunk in enumerate(prompt.chunks):
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise APIError(400, f"prompt chunk {i} is {chunk.type!r}: this server samples text "
                           "only (encoded_text chunks of token ids)", param=f"prompt.chunks.{i}")
        extra = next(iter(chunk.model_extra or ()), None)
        if extra is not None:  # an encoded_text chunk has `type` and `tokens` only
            raise unknown_parameter(f"prompt.chunks.{i}.{extra}")
        ids.extend(chunk.tokens)
    return ids


def plan_sample(body: SampleBody, engine: sv.Engine, max_seqs: int) -> SamplePlan:
    """Check the body against the engine's sizes (400s naming the field) and plan it."""
    sv.check_seqs(body.num_samples, max_seqs, "num_samples")
    if body.num_samples < 1:
        raise APIError(400, "num_samples must be >= 1", param="num_samples")
    if not 0 <= body.topk_prompt_logprobs <= MAX_TOPK:
        raise APIError(400, f"topk_prompt_logprobs must be in [0, {MAX_TOPK}]",
                       param="topk_prompt_logprobs")
    ids = prompt_ids(body.prompt)
    sv.check_ids_length(ids, engine.max_model_len, "prompt")
    sp = body.sampling_params
    max_tokens = engine.max_model_len - len(ids) if sp.max_tokens is None else sp.max_tokens
    sv.check_max_tokens(max_tokens)
    prompt = sv.Prompt("", ids)
    sv.check_prompt(prompt, max_tokens, engine, "prompt")
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    stop_ids = [s for s in stop if isinstance(s, int)]
    sv.check_token_ids(stop_ids, engine.vocab_size, "sampling_params.stop")
    topk = body.topk_prompt_logprobs
    wants = bool(body.prompt_logprobs)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        seed=sp.seed, stop=[s for s in stop if isinstance(s, str)], stop_token_ids=stop_ids,
        logprobs=0, prompt_logprobs=topk if topk or wants else None)
    return SamplePlan(prompt, params, body.num_samples, wants, topk)


def engine_requests(request_id: str, plan: SamplePlan, resolved: ResolvedModel, weight: float,
                    attempt: int = 0) -> list[GenerateRequest]:
    """The plan's engine requests on the `resolved` model, with its admission's fair-share
    `weight` (ids fresh per attempt: the engine refuses a reused id)."""
    return sv.fan_out(f"{request_id}-{attempt}", [plan.prompt], plan.n, plan.params, resolved,
                      weight, stream=False)


# -- one sequence's output -----------------------------------------------------------------------

@dataclass(slots=True)
class SequenceOutput:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.tokens += out.token_ids
        self.logprobs += [finite(lp.logprob) for lp in out.logprobs or ()]
        self.finish_reason = out.finish_reason or self.finish_reason


class SequenceAborted(Exception):
    """The engine ended a sequence without finishing it."""


def sample_response(plan: SamplePlan, seqs: Sequence[SequenceOutput],
                    prompt_lps: list[Any] | None) -> dict[str, Any]:
    """The SampleResponse body; SequenceAborted when a sequence did not stop or reach length."""
    for seq in seqs:
        if seq.finish_reason not in ("stop", "length"):
            raise SequenceAborted(f"the server ended a sequence before it finished "
                                  f"({seq.finish_reason or 'no reason'}); sample again")
    return {"type": "sample",
            "sequences": [{"stop_reason": s.finish_reason, "tokens": s.tokens,
                           "logprobs": s.logprobs} for s in seqs],
            "prompt_logprobs": None if prompt_lps is None or not plan.want_prompt_logprobs else
            [None if e is None else finite(e.logprob) for e in prompt_lps],
            "topk_prompt_logprobs": None if prompt_lps is None or not plan.topk else
            [None if e is None else _topk(e.top, plan.topk) for e in prompt_lps]}


def _topk(top: dict[int, float], k: int) -> list[list[float | int]]:
    best = sorted(top.items(), key=lambda item: -item[1])[:k]
    return [[token_id, finite(lp)] for token_id, lp in best]


# -- running it ----------------------------------------------------------------------------------

async def generate(engine: Any, request_id: str, plan: SamplePlan, adapter: ResolvedModel,
                   weight: float, starting: Awaitable[list[PrimedStream]],
                   on_capacity: Callable[[], None], on_started: Callable[[], None],
                   ) -> tuple[list[SequenceOutput], Any]:
    """Run the plan to the end: (its SequenceOutputs, the prompt's logprob entries or None).

    `starting` is the first start_all of the plan's requests (`weight`: their admission's).
    While the engine is at capacity (its 429) the requests are offered again every
    CAPACITY_RETRY_S, `on_capacity()` told; `on_started()` when every sequence has its first
    output.
    """
    attempt = 0
    while True:
        try:
            streams = await starting
            break
        except EngineError as exc:
            if exc.status != 429:
                raise
            on_capacity()
            attempt += 1
            await asyncio.sleep(CAPACITY_RETRY_S)
            starting = start_all(engine, engine_requests(request_id, plan, adapter, weight, attempt))
    on_started()
    seqs = [SequenceOutput() for _ in streams]
    prompt_lps = None
    async for index, out in merge(streams):
        seqs[index].add(out)
        if prompt_lps is None and out.prompt_logprobs is not None:
            prompt_lps = out.prompt_logprobs
    return seqs, prompt_lps


def failure(exc: BaseException) -> dict[str, Any]:
    """The retrieve_future body of a failed future: the SDK raises it as RequestFailedError."""
    if isinstance(exc, SequenceAborted):
        return {"error": str(exc), "category": "server"}
    error = as_api_error(exc)
    return {"error": error.message, "category": "user" if error.status < 500 else "server"}
