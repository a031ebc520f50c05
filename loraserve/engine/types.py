"""The engine's request/response contract, shared by the engine and the HTTP server."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from loraserve.catalog.records import RevisionRecord

# torch.Generator.manual_seed takes any integer in [-2**63, 2**64)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOKENS_LIMIT = 2**31 - 1
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default, and the engine's (chat uses the room left)
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch here
FLOAT32_MAX = 3.4028234663852886e+38
# stop strings are searched after every token of the request, on the API server's event loop
# (OutputProcessor), so their number and length are bounded: OpenAI takes up to 4
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# logit_bias is applied every step of the request: its size is bounded (OpenAI's is 300 tokens)
MAX_LOGIT_BIAS = 1024
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 1e-30, 1e30


class EngineError(Exception):
    """A request the engine cannot serve. `status` is the HTTP status the server answers with."""

    status: int = 400
    code: str = "invalid_request"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.param = param


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class GrammarSpec(NamedTuple):
    """Structured output (engine/core/structured.py): kind in STRUCTURED_KINDS; text: the JSON
    schema (JSON text), the regex, the choices (a JSON list of strings), the EBNF grammar; ""
    for json_object. `param`: the request field it came from (the 400 names it); not part of
    the compiled-grammar cache key. A NamedTuple: it travels on the engine-core wire as an array."""

    kind: str
    text: str
    param: str = "response_format"

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0/-1 = off; top_p 1 = off.

    Every field has an explicit range, checked here (the API's 400s) so that nothing out of range
    reaches a batch: seed in [-2**63, 2**64), finite temperature and top_p, non-empty stop
    strings (at most MAX_STOP_STRINGS, each at most MAX_STOP_CHARS long). top_k's upper bound
    (the vocabulary) is the engine's check; logit_bias ids against the vocabulary the server's.

    vLLM's extensions (sampler.py applies them, per sequence, in this order, as vLLM does):
    `min_tokens` (EOS and `stop_token_ids` cannot end the sequence before that many tokens),
    `logit_bias` (token id -> added to its logit, OpenAI's [-100, 100]), `repetition_penalty`
    (> 0; 1 = off: a token seen in the prompt or the output has a positive logit divided by it,
    a negative one multiplied), `presence_penalty` / `frequency_penalty` ([-2, 2], OpenAI's:
    subtracted once per token present in the output / once per occurrence there), then after the
    temperature `min_p` ([0, 1]: drop tokens whose probability is below min_p times the top
    one's). `structured` (a GrammarSpec) masks each step's logits to the tokens its grammar
    allows, after the others, before the temperature. Logprobs stay the model's raw distribution."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # top-k logprobs per generated token (0 = chosen only)
    prompt_logprobs: int | None = None   # same, for prompt tokens (echo)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # the API side's text (engine/client/output_processor.py; the core never reads them):
    # special tokens' text left out, and the stop string or stop token that ended it kept
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: the grammar the sampled tokens must follow (None = free)
    structured: GrammarSpec | None = None
    # derived, set by __post_init__ whatever is passed: whether any of the extensions above is
    # on. A field (not a property) so that the sampler's per-step check is one attribute read.
    adjusts_logits: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise EngineError(f"max_tokens must be in [0, {MAX_TOKENS_LIMIT}]", param="max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise EngineError("temperature must be a finite number >= 0", param="temperature")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise EngineError("top_p must be in (0, 1]", param="top_p")
        # the sampler computes in float32: a top_p that underflows there (1e-300 is 0.0) would
        # drop every token, and a temperature past its range is Inf. Clamped to the nearest
        # float32 that means the same: the smallest normal top_p keeps exactly the top token,
        # the largest temperature already flattens any finite logits to uniform.
        self.top_p = max(self.top_p, FLOAT32_TINY)
        self.temperature = min(self.temperature, FLOAT32_MAX)
        if self.top_k < -1:
            raise EngineError("top_k must be -1 or 0 (off) or >= 1", param="top_k")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise EngineError("seed must be an integer in [-2**63, 2**64)", param="seed")
        if any(not s for s in self.stop):
            raise EngineError("stop strings must not be empty", param="stop")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise EngineError(f"at most {MAX_STOP_STRINGS} stop strings of at most "
                              f"{MAX_STOP_CHARS} characters each", param="stop")
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise EngineError("stop_token_ids must be token ids >= 0", param="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise EngineError(f"{name} must be in [0, 20]", param=name)
        self._check_extensions()

    def _check_extensions(self) -> None:
        """vLLM's sampling extensions: ranges, and the float32 clamps (see __post_init__)."""
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise EngineError("min_p must be in [0, 1]", param="min_p")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise EngineError("repetition_penalty must be a finite number > 0 (1 = off)",
                              param="repetition_penalty")
        # a scale outside these bounds overflows float32 logits (then NaN): at the bound a seen
        # token with a positive logit already outranks every unseen one, as it would beyond
        self.repetition_penalty = min(max(self.repetition_penalty, REPETITION_PENALTY_MIN),
                                      REPETITION_PENALTY_MAX)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise EngineError(f"{name} must be in [-2, 2]", param=name)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise EngineError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens",
                              param="logit_bias")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**31:
                raise EngineError("logit_bias keys must be token ids >= 0", param="logit_bias")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise EngineError("logit_bias values must be in [-100, 100]", param="logit_bias")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise EngineError(f"min_tokens must be in [0, max_tokens] ([0, {self.max_tokens}])",
                              param="min_tokens")
        if self.structured is not None:
            if not isinstance(self.structured, GrammarSpec):  # from the wire: a list
                self.structured = GrammarSpec(*self.structured)
            if self.structured.kind not in STRUCTURED_KINDS or not isinstance(self.structured.text, str):
                raise EngineError(f"unknown structured output kind {self.structured.kind!r}",
                                  param=self.structured.param)
        self.adjusts_logits = bool(self.structured is not None or self.min_p or self.repetition_penalty != 1.0
                                   or self.presence_penalty or self.frequency_penalty
                                   or self.logit_bias or self.min_tokens)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A request's model, decided once at the edge (`directory.AdapterDirectory.resolve`): `name`
    as the request gave it, `ref` the loraserve reference it stands for (`tenant/name@rev` of the
    revision it runs, or the base's name), the adapter's key and revision record (None for the
    base) and the tenant it is charged to ("" for the base)."""

    name: str
    ref: str
    adapter: tuple[str, str] | None = None
    record: RevisionRecord | None = None
    tenant: str = ""

    @property
    def is_base(self) -> bool:
        return self.adapter is None


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # catalog model ref "tenant/name[@rev]"; None = base only
    # False: the caller reads the answer whole (a non-streamed HTTP request): it gets the first
    # delta (errors and TTFT surface as early as ever), then one merged delta at the end, not one
    # per step, so the event loop is not woken per token per request (EngineCore merges in the
    # core when the request has no stop strings, the OutputProcessor otherwise).
    stream: bool = True
    # Fair share: the scheduler admits waiting sequences round-robin across tenants, `weight`
    # turns per round. Empty tenant: the adapter's tenant, or "" for the base model.
    tenant: str = ""
    tenant_weight: float = 1.0
    # decided at the edge (the server's path): the revision this request runs, never resolved
    # again below; `adapter` and `tenant` follow from it. None: `adapter` is resolved by the
    # engine's frontend for an in-process caller (tests, bench) that names it only.
    resolved: ResolvedModel | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tenant_weight) and self.tenant_weight > 0):
            raise EngineError("tenant weight must be a finite number > 0")
        if self.resolved is not None:
            self.adapter = None if self.resolved.is_base else self.resolved.ref
            self.tenant = self.tenant or self.resolved.tenant
        if not self.tenant and self.adapter:
            self.tenant = self.adapter.split("/", 1)[0]

    def check(self, vocab_size: int, max_model_len: int) -> None:
        """The checks that need the model's sizes. Raises EngineError (400)."""
        ids, p = self.prompt_token_ids, self.params
        check_prompt_ids(ids, vocab_size, "prompt")
        if p.top_k > vocab_size:
            raise EngineError(f"top_k must be at most the vocabulary size {vocab_size}", param="top_k")
        check_context(len(ids), p.max_tokens, max_model_len, "max_tokens")


# -- the request rules that need the model's sizes: one copy, for the API edge (server.serving,
# which checks them before a request is built) and the engine (GenerateRequest.check, for an
# in-process caller) ---------------------------------------------------------------------------
def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """Every id inside the vocabulary [0, vocab_size). Raises EngineError (400) naming `param`."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def check_prompt_ids(ids, vocab_size: int, param: str) -> None:
    """A prompt: non-empty, its ids inside the vocabulary."""
    if not ids:
        raise EngineError(f"{param} must not be empty", param=param)
    check_token_ids(ids, vocab_size, param)


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, param: str) -> None:
    """Prompt + completion within the context (vLLM's words and code)."""
    if prompt_len + max_tokens > max_model_len:
        raise EngineError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).", param=param, code="context_length_exceeded")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # top-k alternatives (token id -> logprob), may include token_id


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's output: the tokens generated since the previous delta."""

    request_id: str
    token_ids: list[int]
    text: str                                   # detokenized text of token_ids (stop strings cut)
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when requested
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first delta only; [0] is None
    finish_reason: str | None = None            # "stop" | "length" | "abort" | None (running)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0                  # cumulative
    adapter_revision: str | None = None         # the revision the request runs on
    error: Exception | None = None              # engine-internal: AsyncEngine raises it instead
    # first delta only: where the revision was as the request reached the engine: "device" (in
    # the pool), "cpu" (the CPU cache) or "catalog" (paged in from disk); None for the base
    adapter_tier: str | None = None
    # the finishing delta only: (queue_s, prefill_s, decode_s) as the engine timed them: arrival
    # to first scheduled, first scheduled to first token, first token to the end (vLLM's
    # request_queue/prefill/decode_time_seconds); None before the end and for an error
    timings: tuple[float, float, float] | None = None

    @classmethod
    def failed(cls, request_id: str, err: Exception, num_prompt_tokens: int = 0) -> RequestOutput:
        """The last delta of a request that ends in `err` (finish reason "error")."""
        return cls(request_id=request_id, token_ids=[], text="", finish_reason="error",
                   num_prompt_tokens=num_prompt_tokens, error=err)

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later`, as one delta (what a reader of both would have seen)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(  # the later delta's state, both deltas' tokens and text
            request_id=self.request_id, token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            finish_reason=later.finish_reason, num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens,
            adapter_revision=later.adapter_revision or self.adapter_revision, error=later.error,
            adapter_tier=self.adapter_tier or later.adapter_tier, timings=later.timings)


FIRST = object()  # a non-streamed request whose first delta is not out yet (`coalesce`)


def coalesce(held: object, out: RequestOutput, last: bool) -> tuple[object, RequestOutput | None]:
    """The non-streamed merge rule, one copy for the engine core (`EngineCore`) and the API side
    (`OutputProcessor`): the first delta goes out as it is, then nothing until the last, which
    carries every delta since the first merged. `held` is FIRST (the first is not out yet), None
    (nothing held) or the deltas merged since the first; returns (what to hold now, what to hand
    over now or None)."""
    if last:
        return None, (out if held is FIRST or held is None else held.merged(out))
    if held is FIRST:
        return None, out
    return (out if held is None else held.merged(out)), None
