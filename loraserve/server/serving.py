"""What both generation endpoints share: the engine facade, the server's limits, model
resolution, request and prompt checks, sampling parameters, fan-out into engine requests, and
per-request timing."""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from loraserve.engine import types
from loraserve.engine.interface import EngineInterface
from loraserve.engine.types import (SEED_MAX, EngineError, GenerateRequest, GrammarSpec,
                                    ResolvedModel, SamplingParams)
from loraserve.server.config import ServerConfig
from loraserve.server.errors import APIError, as_api_error, clip
from loraserve.server.grammar_checks import GrammarChecks
from loraserve.server.metrics import ServerMetrics
from loraserve.server.request_log import encodable
from loraserve.server.names import lookup_error
from loraserve.server.protocol import (CHARS_PER_TOKEN_MAX, InputLimits, SamplingFields,
                                       too_long_message)
from loraserve.server.streaming import ShutdownDeadline

# one INFO line per request that carries end-user identifiers (`user`, `metadata`, ...)
request_log = logging.getLogger("loraserve.server.requests")


Engine = EngineInterface  # the engine as the server sees it: loraserve/engine/interface.py


@dataclass(slots=True)
class ServerContext:
    """What a route handler needs: the engine, the app's metrics and the server's configuration
    (`config.max_request_bytes` bounds a request body (413), `max_seqs_per_request` the sequences
    (prompts x n) one request may start (400); `shutdown_timeout` is how long in-flight requests
    may run on once shutdown begins before `deadline` ends them (503 / an error event))."""

    engine: Engine
    metrics: ServerMetrics
    config: ServerConfig = field(default_factory=ServerConfig)
    deadline: ShutdownDeadline = field(default_factory=ShutdownDeadline)
    grammars: GrammarChecks = field(default_factory=GrammarChecks)  # users' grammars, off the loop

    @property
    def max_n(self) -> int:
        return self.config.max_n

    @property
    def max_request_bytes(self) -> int:
        return self.config.max_request_bytes

    @property
    def max_seqs_per_request(self) -> int:
        return self.config.max_seqs_per_request

    @property
    def shutdown_timeout(self) -> float:
        return self.config.shutdown_timeout

    @property
    def limits(self) -> InputLimits:
        """The input bounds request bodies are checked against before anything else."""
        return InputLimits(self.engine.max_model_len, self.max_seqs_per_request)


@dataclass(slots=True)
class Prompt:
    """One prompt: the text echoed back and the token ids sent to the engine."""

    text: str
    token_ids: list[int]


@dataclass(slots=True)
class RequestClock:
    """Arrival time of one HTTP request; reports TTFT and end-to-end latency once each."""

    metrics: ServerMetrics
    start: float = field(default_factory=time.perf_counter)
    first_seen: bool = False

    def first_output(self) -> None:
        if not self.first_seen:
            self.first_seen = True
            self.metrics.ttft.observe(time.perf_counter() - self.start)

    def finished(self) -> None:
        self.metrics.e2e_latency.observe(time.perf_counter() - self.start)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_request(req: SamplingFields, ctx: ServerContext) -> None:
    """Check the fields every generation request has (its `model` is the directory's:
    `resolve_model`). End-user identifiers the request carries (`user`, ...) are logged here,
    at INFO."""
    reject_unsupported(req.unsupported())
    check_n(req.n, ctx.max_n)
    check_seqs(req.num_prompts() * req.n, ctx.max_seqs_per_request,
               "prompt" if req.n == 1 else "n")
    check_stop_token_ids(req.stop_token_ids, ctx.engine.vocab_size)
    check_logit_bias(req.logit_bias, ctx.engine.vocab_size)
    identifiers = req.identifiers()
    if identifiers:
        request_log.info("request for %s from %s", encodable(clip(req.model)),
                         encodable(clip(json.dumps(identifiers, ensure_ascii=False), 2048)))


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> None:
    """logit_bias keys are token ids (decimal strings, as OpenAI takes them) in the vocabulary;
    the values' range is SamplingParams'."""
    seen: set[int] = set()
    for key in bias or ():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), "
                           f"got {clip(key, 32)!r}", param="logit_bias")
        if int(key) in seen:
            raise APIError(400, f"logit_bias names token {int(key)} twice", param="logit_bias")
        seen.add(int(key))


def check_seqs(seqs: int, max_seqs: int, param: str = "n") -> None:
    """One request starts prompts x n sequences; more than `max_seqs` is a 400."""
    if seqs > max_seqs:
        raise APIError(400, f"this request asks for {seqs} sequences (prompts x n); the server "
                       f"accepts at most {max_seqs} per request (--max-seqs-per-request)",
                       param=param, code="too_many_sequences")


def check_text_length(text: str, max_model_len: int, param: str) -> None:
    """A text that cannot fit the context whatever it tokenizes to: 400 before tokenizing."""
    if len(text) > max_model_len * CHARS_PER_TOKEN_MAX:
        raise APIError(400, too_long_message(max_model_len, len(text), "characters"),
                       param=param, code="context_length_exceeded")


def check_ids_length(ids: Sequence[int], max_model_len: int, param: str) -> None:
    """A token-id list longer than the context: 400 before any per-id work."""
    if len(ids) > max_model_len:
        raise APIError(400, too_long_message(max_model_len, len(ids), "tokens"), param=param,
                       code="context_length_exceeded")


def reject_unsupported(found: tuple[str, str] | str | None) -> None:
    """400 `unsupported_parameter` for (name, reason), or a bare name, of a field the request
    set to a value the server does not honour (protocol: `unsupported()`)."""
    if found is None:
        return
    name, reason = (found, "") if isinstance(found, str) else found
    raise APIError(400, f"`{name}` is not supported by this server" + (f": {reason}" if reason
                                                                         else ""),
                   param=name, code="unsupported_parameter")


def check_n(n: int, max_n: int) -> None:
    if not 1 <= n <= max_n:
        raise APIError(400, f"n must be in [1, {max_n}], got {n}", param="n")


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """engine.types.check_token_ids at the edge: an APIError (400 naming `param`)."""
    with _as_api_error():
        types.check_token_ids(ids, vocab_size, param)


def check_prompt(prompt: Prompt, max_tokens: int, engine: Engine, param: str) -> None:
    """Non-empty, ids inside the vocabulary, prompt + max_tokens within max_model_len (vLLM):
    the engine's own rules (engine.types), checked here before a request is built."""
    with _as_api_error():
        types.check_prompt_ids(prompt.token_ids, engine.vocab_size, param)
        types.check_context(len(prompt.token_ids), max_tokens, engine.max_model_len, param)


@contextmanager
def _as_api_error() -> Iterator[None]:
    try:
        yield
    except EngineError as exc:
        raise as_api_error(exc) from None


def check_max_tokens(max_tokens: int, minimum: int = 0) -> None:
    if max_tokens < minimum:
        raise APIError(400, f"max_tokens must be >= {minimum}, got {max_tokens}",
                       param="max_tokens")


def check_stop_token_ids(ids: Sequence[int] | None, vocab_size: int) -> None:
    check_token_ids(ids or (), vocab_size, "stop_token_ids")


async def resolve_model(model: str, principal: Any, engine: Engine) -> ResolvedModel:
    """What `model` names for `principal`, decided once for the whole request (the engine's
    `AdapterDirectory`): a name the key may not see or that names nothing is the one 404 of
    `names.not_found`, echoing `model` as given."""
    try:
        return await engine.resolve(model, principal)
    except Exception as exc:
        err = lookup_error(exc, model)
        if err is exc:
            raise
        raise err from exc


def fan_out(request_id: str, prompts: Sequence[Prompt], n: int, params: SamplingParams,
            resolved: ResolvedModel, weight: float, stream: bool = True) -> list[GenerateRequest]:
    """P * n engine requests, prompt-major, each carrying the request's `resolved` model (the
    engine runs its revision and resolves nothing) and its admission's fair-share `weight`
    (`tenancy.admit`; nothing below writes either); choice i of a seeded request samples with
    seed + i. stream=False (a non-streamed answer) lets the engine merge the deltas after the
    first."""
    requests = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            seeded = params if params.seed is None or i == 0 else _with_seed(params,
                                                                             _nth_seed(params.seed, i))
            requests.append(GenerateRequest(request_id=f"{request_id}-{p * n + i}",
                                            prompt_token_ids=list(prompt.token_ids),
                                            params=seeded, stream=stream, resolved=resolved,
                                            tenant_weight=weight))
    return requests


def _nth_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into the engine's seed range [-2**63, 2**64) (modulo 2**64)."""
    return seed + i if seed + i <= SEED_MAX else seed + i - 2**64


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    fields = {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
    fields["seed"] = seed
    fields["stop"] = list(params.stop)
    fields["stop_token_ids"] = list(params.stop_token_ids)
    return SamplingParams(**fields)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from a request's shared fields; OpenAI defaults where the client sent none.
    `prompt_logprobs` (the echo's) and the request's own `prompt_logprobs` (vLLM's): the engine
    computes the larger, each answer cuts its own.

    Out-of-range values raise EngineError (answered 400 with `param`).
    """
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= 20:
            raise EngineError("prompt_logprobs must be in [0, 20] (vLLM's -1, the whole "
                              "vocabulary, is not served)", param="prompt_logprobs")
        prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed, stop=req.stop_list(), stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        min_tokens=req.min_tokens or 0, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured=structured_spec(req))


def _bad(param: str, message: str) -> EngineError:
    return EngineError(f"{param}: {message}", param=param)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> its JSON text, keys in the order the
    client wrote them: properties are generated in the schema's order (a `reasoning` before an
    `answer` is written first), so the text, and with it the compiled grammar's cache key, keeps
    that order (two orders are two grammars)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, "must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(value, dict):
        raise _bad(param, "must be a JSON schema (an object, or its JSON text)")
    return json.dumps(value)


def _choice_text(value: Any, param: str) -> str:
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise _bad(param, "must be a non-empty list of non-empty strings")
    return json.dumps(value)


def _string(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(param, f"must be a non-empty string ({what})")
    return value


def _response_format(rf: Any) -> GrammarSpec | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""
    param = "response_format"
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
            raise _bad(param, "json_schema must be an object {\"name\", \"schema\", \"strict\"}")
        if js.get("schema") is None:
            return GrammarSpec("json_object", "", param)
        return GrammarSpec("json_schema", _schema_text(js["schema"], param), param)
    raise EngineError(f"{param}: this type is not supported; only \"text\", \"json_object\" "
                      "or \"json_schema\"",
                      param=param, code="unsupported_parameter")


# structured_outputs' keys (vLLM) -> the guided_* field they mean
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar", "json_object": "json_object"}


def _guided(name: str, value: Any, param: str) -> GrammarSpec:
    if name == "guided_json":
        return GrammarSpec("json_schema", _schema_text(value, param), param)
    if name == "guided_regex":
        return GrammarSpec("regex", _string(value, param, "a regular expression"), param)
    if name == "guided_choice":
        return GrammarSpec("choice", _choice_text(value, param), param)
    if name == "guided_grammar":
        return GrammarSpec("grammar", _string(value, param, "an EBNF grammar"), param)
    if value is not True:
        raise _bad(param, "json_object must be true")
    return GrammarSpec("json_object", "", param)


def structured_spec(req: SamplingFields) -> GrammarSpec | None:
    """The request's structured output, or None: at most one of response_format (json_object,
    json_schema), guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs.
    Its grammar is parsed before the request is queued, in a grammar worker process under a
    deadline and the tenant's budget (`endpoint.serve`: `grammar_checks.GrammarChecks`, never
    on the event loop); the engine compiles it against the vocabulary when it admits the
    sequence. EngineError (400 naming the field) otherwise."""
    specs: list[GrammarSpec] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            specs.append(spec)
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            specs.append(_guided(name, value, name))
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        given = {k: v for k, v in so.items() if v is not None} if isinstance(so, dict) else None
        if not given or len(given) != 1 or next(iter(given)) not in _STRUCTURED_OUTPUTS:
            raise _bad(param, "must be an object with exactly one of "
                       + ", ".join(_STRUCTURED_OUTPUTS))
        key, value = next(iter(given.items()))
        specs.append(_guided(_STRUCTURED_OUTPUTS[key], value, f"{param}.{key}"))
    if not specs:
        return None
    if len(specs) > 1:
        raise EngineError(f"at most one structured output per request: {specs[0].param} and "
                          f"{specs[1].param} were both given", param=specs[1].param)
    return specs[0]
