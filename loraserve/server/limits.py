"""Per-tenant limits (token buckets, sequences in flight) and per-tenant Prometheus counters.

A key's `Limits` bound its use of each tenant separately: the state is kept per (key id,
tenant), so one tenant over its limit gets 429s while every other tenant is served. A request is
charged at admission: one request, `n` x (prompt + max_tokens) tokens summed over its prompts,
and its P x n sequences, which stay in flight until the HTTP request ends (`Lease.release`).

All state here is owned by the event loop: admission and release run on it, nothing else
touches it, so there are no locks.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from loraserve.keys import Limits, Principal
from loraserve.server.errors import APIError
from loraserve.server.metrics import ServerMetrics

CONCURRENCY, REQUESTS, TOKENS = "max_concurrent", "requests_per_second", "tokens_per_minute"


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens per second up to `capacity`; starts full."""

    rate: float
    capacity: float
    level: float
    stamp: float

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> TokenBucket:
        return cls(rate, capacity, capacity, now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, amount: float) -> float:
        """Seconds until `amount` tokens are there (0: now; inf: never, over the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)


@dataclass(slots=True)
class Usage:
    """What one (key, tenant) holds: sequences in flight and its buckets."""

    limits: Limits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0

    @classmethod
    def of(cls, limits: Limits, now: float) -> Usage:
        rps, tpm = limits.requests_per_second, limits.tokens_per_minute
        return cls(limits,
                   None if rps is None else TokenBucket.full(rps, max(1.0, rps), now),
                   None if tpm is None else TokenBucket.full(tpm / 60.0, float(tpm), now))


@dataclass(slots=True)
class Lease:
    """Sequences one admitted request holds in its (key, tenant)'s count until `release`."""

    usage: Usage | None
    sequences: int
    released: bool = False

    def release(self) -> None:
        if not self.released and self.usage is not None:
            self.usage.in_flight -= self.sequences
        self.released = True


class LimitExceeded(APIError):
    """The 429 of a tenant over one of its key's limits (`limit` names it): OpenAI's
    rate_limit_error body, and `Retry-After` when the request would fit (60 when it never can).
    """

    def __init__(self, limit: str, value: float, message: str, retry_after: float):
        seconds = 60 if math.isinf(retry_after) else max(1, math.ceil(retry_after))
        super().__init__(429, f"Rate limit reached ({limit} = {value:g}): {message}",
                         code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})
        self.limit = limit


class Limiter:
    """Admission against each key's limits, per (key id, tenant). Event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: dict[tuple[str | None, str], Usage] = {}

    def admit(self, principal: Principal, tenant: str, sequences: int, tokens: int) -> Lease:
        """A lease on `sequences`, with one request and `tokens` taken from the buckets; or the
        429 of the first limit that does not allow it now (nothing is taken then)."""
        limits = principal.limits
        if not limits.any:
            return Lease(None, sequences)
        usage = self._usage_of(principal.key_id, tenant, limits)
        now = self.clock()
        for bucket in (usage.requests, usage.tokens):
            if bucket is not None:
                bucket.refill(now)
        self._check(usage, sequences, tokens)
        if usage.requests is not None:
            usage.requests.level -= 1
        if usage.tokens is not None:
            usage.tokens.level -= tokens
        usage.in_flight += sequences
        return Lease(usage, sequences)

    def _usage_of(self, key_id: str | None, tenant: str, limits: Limits) -> Usage:
        """The (key, tenant)'s usage. A reload that changed the key's limits gets new buckets
        in the same Usage: the leases of requests in flight still release into it."""
        usage = self._usage.get((key_id, tenant))
        if usage is None:
            usage = self._usage[(key_id, tenant)] = Usage.of(limits, self.clock())
        elif usage.limits != limits:
            fresh = Usage.of(limits, self.clock())
            usage.limits, usage.requests, usage.tokens = limits, fresh.requests, fresh.tokens
        return usage

    @staticmethod
    def _check(usage: Usage, sequences: int, tokens: int) -> None:
        lim = usage.limits
        if lim.max_concurrent is not None and usage.in_flight + sequences > lim.max_concurrent:
            never = sequences > lim.max_concurrent
            raise LimitExceeded(CONCURRENCY, lim.max_concurrent,
                                f"this request needs {sequences} sequences" if never else
                                f"{usage.in_flight} sequences of this tenant are in flight",
                                math.inf if never else 1.0)
        if usage.requests is not None and (wait := usage.requests.wait(1)) > 0:
            raise LimitExceeded(REQUESTS, usage.requests.rate,
                                "too many requests for this tenant", wait)
        if usage.tokens is not None and (wait := usage.tokens.wait(tokens)) > 0:
            raise LimitExceeded(TOKENS, usage.tokens.capacity,
                                f"this request is charged {tokens} tokens (prompt + max_tokens)",
                                wait)


class TenantCounters:
    """Prometheus counters labelled by tenant only (never an adapter id or a key)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.requests = Counter("loraserve_tenant_requests", "Requests started, by tenant",
                                ["tenant"], registry=None)
        self.prompt_tokens = Counter("loraserve_tenant_prompt_tokens",
                                     "Prompt tokens of started requests, by tenant", ["tenant"],
                                     registry=None)
        self.generation_tokens = Counter("loraserve_tenant_generation_tokens",
                                         "Tokens generated, by tenant", ["tenant"], registry=None)
        self.rejections = Counter("loraserve_tenant_rejections",
                                  "Requests refused with 429 at a tenant's limit, by limit",
                                  ["tenant", "reason"], registry=None)
        for counter in (self.requests, self.prompt_tokens, self.generation_tokens,
                        self.rejections):
            metrics.register(counter)

    def started(self, tenant: str, prompt_tokens: int) -> None:
        self.requests.labels(tenant=tenant).inc()
        self.prompt_tokens.labels(tenant=tenant).inc(prompt_tokens)

    def generated(self, tenant: str, tokens: int) -> None:
        if tokens:
            self.generation_tokens.labels(tenant=tenant).inc(tokens)

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant=tenant, reason=reason).inc()
