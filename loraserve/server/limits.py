"""Per-tenant limits (token buckets, sequences in flight) and per-tenant Prometheus counters.

Two sets of `Limits` bound a request, each with its own state:

- its tenant's (`[tenants.<name>]` in the keys file), kept per tenant: every key's requests
  charged to the tenant count against them together, so two keys of a tenant share one
  tenant's worth;
- its key's own (the limit fields of `[keys.<id>]`), kept per (key id, tenant): they can only
  make the tenant's tighter for that key.

One tenant over a limit gets 429s while every other tenant is served. A request is charged at
admission: one request, `n` x (prompt + max_tokens) tokens summed over its prompts, and its
P x n sequences, which stay in flight until the HTTP request ends (`Lease.release`). Tokens are
charged for what is computed: when the request ends, the tokens it was charged for but did not
use (max_tokens it did not generate, a prompt never prefilled) go back to the buckets, so
the bucket counts prompt tokens and generated tokens.

All state here is owned by the event loop: admission and release run on it, nothing else
touches it, so there are no locks.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)

    def wait(self, amount: float) -> float:
        """Seconds until `amount` tokens are there (0: now; inf: never, over the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)


@dataclass(slots=True)
class Usage:
    """What one tenant, or one (key, tenant), holds: sequences in flight and its buckets."""

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
    """What one admitted request holds until `release`: its sequences in the counts of its
    tenant and its key (`usages`), and the `tokens` taken from their buckets, of which `used`
    were computed (prompt and generated tokens, counted as the request runs); release gives
    the rest back. `used` None: unknown, nothing is given back."""

    usages: tuple[Usage, ...]
    sequences: int
    tokens: int = 0
    used: int | None = None
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        unused = 0 if self.used is None else max(0, self.tokens - self.used)
        for usage in self.usages:
            usage.in_flight -= self.sequences
            if unused and usage.tokens is not None:
                usage.tokens.give_back(unused)


class LimitExceeded(APIError):
    """The 429 of a tenant over one of its limits or its key's (`limit` names it): OpenAI's
    rate_limit_error body, and `Retry-After` when the request would fit (60 when it never can).
    """

    def __init__(self, limit: str, value: float, message: str, retry_after: float):
        seconds = 60 if math.isinf(retry_after) else max(1, math.ceil(retry_after))
        super().__init__(429, f"Rate limit reached ({limit} = {value:g}): {message}",
                         code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})
        self.limit = limit


class Limiter:
    """Admission against each tenant's limits (per tenant, all its keys together) and each
    key's own (per key id and tenant). Event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: dict[tuple[str | None, str], Usage] = {}  # (key id, tenant): the key's
        self._tenant_usage: dict[str, Usage] = {}                 # tenant: all its keys'

    def admit(self, principal: Principal, tenant: str, sequences: int, tokens: int,
              tenant_limits: Limits | None = None) -> Lease:
        """A lease on `sequences`, with one request and `tokens` taken from the buckets of the
        tenant (`tenant_limits`) and of the key in it; or the 429 of the first limit that does
        not allow it now, the tenant's first (nothing is taken then)."""
        held = []  # (usage, whose)
        if tenant_limits is not None and tenant_limits.any:
            held.append((self._of(self._tenant_usage, tenant, tenant_limits), "this tenant"))
        if principal.limits.any:
            held.append((self._of(self._usage, (principal.key_id, tenant), principal.limits),
                         "this key"))
        if not held:
            return Lease((), sequences)
        now = self.clock()
        for usage, _ in held:
            for bucket in (usage.requests, usage.tokens):
                if bucket is not None:
                    bucket.refill(now)
        for usage, whose in held:
            self._check(usage, sequences, tokens, whose)
        usages = tuple(usage for usage, _ in held)
        for usage in usages:
            if usage.requests is not None:
                usage.requests.level -= 1
            if usage.tokens is not None:
                usage.tokens.level -= tokens
            usage.in_flight += sequences
        return Lease(usages, sequences, tokens)

    def _of(self, table: dict, key: Any, limits: Limits) -> Usage:
        """The usage kept under `key`. A reload that changed its limits gets new buckets in the
        same Usage: the leases of requests in flight still release into it."""
        usage = table.get(key)
        if usage is None:
            usage = table[key] = Usage.of(limits, self.clock())
        elif usage.limits != limits:
            fresh = Usage.of(limits, self.clock())
            usage.limits, usage.requests, usage.tokens = limits, fresh.requests, fresh.tokens
        return usage

    @staticmethod
    def _check(usage: Usage, sequences: int, tokens: int, whose: str) -> None:
        lim = usage.limits
        if lim.max_concurrent is not None and usage.in_flight + sequences > lim.max_concurrent:
            never = sequences > lim.max_concurrent
            raise LimitExceeded(CONCURRENCY, lim.max_concurrent,
                                f"this request needs {sequences} sequences" if never else
                                f"{usage.in_flight} sequences of {whose} are in flight",
                                math.inf if never else 1.0)
        if usage.requests is not None and (wait := usage.requests.wait(1)) > 0:
            raise LimitExceeded(REQUESTS, usage.requests.rate,
                                f"too many requests for {whose}", wait)
        if usage.tokens is not None and (wait := usage.tokens.wait(tokens)) > 0:
            raise LimitExceeded(TOKENS, usage.tokens.capacity,
                                f"this request is charged {tokens} tokens (prompt + max_tokens), "
                                + (f"more than {whose} may use in a minute" if math.isinf(wait)
                                   else f"more than {whose} has left now"), wait)


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
