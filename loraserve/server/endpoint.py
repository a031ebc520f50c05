"""The request skeleton both generation endpoints run; each endpoint supplies only what differs.

One request: check the fields both endpoints share (serving.check_request) -> its model, decided
once for the key it acts for (serving.resolve_model: the engine's AdapterDirectory) -> the endpoint's
`plan` (its prompts and sampling, checked) -> fan out to the engine, every stream primed, so a
bad request is still a proper 4xx -> the answer, either one JSON body (the endpoint's `head`, every
choice's `to_json`, usage) or an SSE stream (each choice's `opening` entry if it has one, one
chunk per engine delta from the choice's `delta`, usage if asked, `[DONE]`; a failure after the
headers is sent in-band). TTFT, end-to-end latency and token counts are recorded on the way.

A large request is planned (tokenized, echo detokenized) on a worker thread, so the event loop
keeps serving others; a request's grammar is parsed in a worker process under a deadline and a
per-tenant budget (`grammar_checks`), never on the loop; when the server's shutdown deadline
passes, a request still waiting on the engine ends with a 503, a stream with an error event and
`[DONE]`.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse

from loraserve.engine.types import GrammarSpec, RequestOutput, SamplingParams
from loraserve.server.config import ServerConfig
from loraserve.server.errors import sse_error
from loraserve.server.fastjson import FastJSONResponse
from loraserve.server.grammar_checks import tenant_of
from loraserve.server.logprobs import TokenRenderer
from loraserve.server.names import lookup_error
from loraserve.server.protocol import SamplingFields
from loraserve.server.request_log import RequestRecord, current_record
from loraserve.server.serving import (Engine, Prompt, RequestClock, ServerContext, check_request,
                                      fan_out, new_id, now, resolve_model, usage)
from loraserve.server.streaming import DONE, PrimedStream, merge, sse, start_all
from loraserve.server.tenancy import admit

# Requests with more input than this (characters, token ids) are planned off the event loop.
OFF_LOOP_INPUT = 16 * 1024


class Choice(Protocol):
    """One choice's state, in its endpoint's shape; engine deltas arrive in order."""

    num_tokens: int

    def apply(self, out: RequestOutput) -> object:
        """Account one delta (a non-streamed answer)."""
        ...

    def delta(self, out: RequestOutput) -> dict[str, Any]:
        """Account one delta; returns its entry of a streamed chunk's `choices`."""
        ...

    def opening(self) -> dict[str, Any] | None:
        """The entry streamed for this choice before any delta, if any."""
        ...

    def to_json(self) -> dict[str, Any]:
        """The choice in a non-streamed answer."""
        ...


@dataclass(slots=True)
class Plan:
    """What an endpoint asks of the engine for one checked request.

    `new_choice(index, prompt, render)` makes the state of choice `index` (prompt-major:
    choice i answers prompt i // n). `grammar`: the user's grammar the answer must follow, not
    yet parsed (a structured output, or a forced tool call's functions); `serve` has it checked
    off the event loop and puts the result in `params.structured`. An endpoint that gives none
    has `params.structured` checked.
    """

    prompts: list[Prompt]
    params: SamplingParams
    new_choice: Callable[[int, Prompt, TokenRenderer], Choice]
    grammar: GrammarSpec | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What differs between the generation endpoints.

    `plan(req, engine, config)` checks the endpoint's own fields and builds its Plan (raising
    APIError or EngineError for a bad request; `config` is the server's ServerConfig);
    `head(request_id, created, model, chunk)` gives the fields every body (`chunk=False`) or SSE
    chunk (`chunk=True`) starts with; `tail(choices)`, fields a whole body has after its choices
    (chat's `prompt_logprobs`).
    """

    id_prefix: str
    plan: Callable[[Any, Engine, ServerConfig], Plan]
    head: Callable[[str, int, str, bool], dict[str, Any]]
    tail: Callable[[Sequence[Any]], dict[str, Any]] = lambda choices: {}


async def serve(req: SamplingFields, ctx: ServerContext, endpoint: Endpoint, principal: Any) -> Response:
    """Answer one generation request, acting for `principal`, as JSON or as an SSE stream (see
    module doc)."""
    clock = RequestClock(ctx.metrics)
    log = current_record() or RequestRecord("")  # the request's log line (request_log.py)
    engine = ctx.engine
    log.model = req.model
    check_request(req, ctx)
    # the model, decided once: 404 for a name the key may not see as for one that names nothing
    resolved = await resolve_model(req.model, principal, engine)
    log.adapter, log.tenant = resolved.ref, resolved.tenant or None
    if req.input_size() > OFF_LOOP_INPUT:
        plan = await asyncio.to_thread(endpoint.plan, req, engine, ctx.config)
    else:
        plan = endpoint.plan(req, engine, ctx.config)
    request_id = log.response_id = new_id(endpoint.id_prefix)
    log.prompt_tokens = sum(len(p.token_ids) for p in plan.prompts)
    admitted = admit(resolved, principal, plan.prompts, req.n, plan.params.max_tokens)  # 429
    log.tenant = admitted.tenant or None
    grammar = plan.grammar or plan.params.structured
    if grammar is not None:  # parsed in a worker process, under a deadline and tenant budget
        settled = await ctx.grammars.settle(grammar, tenant_of(resolved, principal))
        plan.params = dataclasses.replace(plan.params, structured=settled)
    try:
        streams = await ctx.deadline.run(start_all(admitted.engine(engine), fan_out(
            request_id, plan.prompts, req.n, plan.params, resolved, admitted.weight, bool(req.stream))))
    except Exception as exc:  # a revision gone since it was resolved: the 404 naming it as asked
        err = lookup_error(exc, req.model)
        if err is exc:
            raise
        raise err from exc
    clock.first_output()
    log.ttft_s = log.since_start()
    log.tier = next((s.first.adapter_tier for s in streams if s.first is not None), None)
    prompt_tokens = log.prompt_tokens
    ctx.metrics.prompt_tokens.inc(prompt_tokens)
    ctx.metrics.sequences.admitted(plan.params.max_tokens, len(streams))
    render = TokenRenderer(engine.tokenizer, req.return_tokens_as_token_ids)
    choices = [plan.new_choice(i, plan.prompts[i // req.n], render) for i in range(len(streams))]
    created = now()
    if req.stream:
        head = endpoint.head(request_id, created, req.model, True)
        body = _stream(head, streams, choices, prompt_tokens, req.include_usage(), ctx, clock, log)
        return StreamingResponse(body, media_type="text/event-stream")
    await _collect(streams, choices, ctx, clock, log)
    completion_tokens = log.completion_tokens
    return FastJSONResponse({**endpoint.head(request_id, created, req.model, False),
                         "choices": [c.to_json() for c in choices],
                         **endpoint.tail(choices),
                         "usage": usage(prompt_tokens, completion_tokens)})


async def _collect(streams: Sequence[PrimedStream], choices: Sequence[Choice], ctx: ServerContext,
                   clock: RequestClock, log: RequestRecord) -> None:
    """Non-streamed answer: feed every delta to its choice, counting generated tokens; the clock
    and the log record the end even if the client leaves."""
    try:
        async for index, out in merge(streams, ctx.deadline):
            choices[index].apply(out)
            ctx.metrics.delta(out)
    finally:
        clock.finished()
        log.completion_tokens = sum(c.num_tokens for c in choices)


async def _stream(head: dict[str, Any], streams: Sequence[PrimedStream],
                  choices: Sequence[Choice], prompt_tokens: int, include_usage: bool,
                  ctx: ServerContext, clock: RequestClock, log: RequestRecord) -> AsyncIterator[str]:
    """Opening chunks, one chunk per engine delta, usage (if asked), then [DONE]."""
    extra = {"usage": None} if include_usage else {}
    try:
        for choice in choices:
            opening = choice.opening()
            if opening is not None:
                yield sse({**head, "choices": [opening], **extra})
        async for index, out in merge(streams, ctx.deadline):
            entry = choices[index].delta(out)
            ctx.metrics.delta(out)
            yield sse({**head, "choices": [entry], **extra})
        if include_usage:
            total = sum(c.num_tokens for c in choices)
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, total)})
    except Exception as exc:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(exc)
    finally:
        clock.finished()
        log.completion_tokens = sum(c.num_tokens for c in choices)
    yield DONE
