"""Admission at the API side, in tokens: the one gate every hosting's `EngineClient` passes a
request through before the engine sees it.

A request is charged its tokens, `cost(req)`: its prompt plus `max_tokens`, the most the
engine's scheduler can charge its tenant for it (`core.scheduler`: prefill tokens when
scheduled, one per decode token). Two bounds:

- `slots`: sequences that may be past the gate at once. In one process that is the engine's
  batch plus its queue (`max_batch_size + max_waiting`): the engine's scheduler orders what is
  past the gate. Behind Ray Serve it is the replicas' batches (live replicas x
  `max_batch_size`), because Serve's router queue in front of the replicas is FIFO: a tenant's
  burst that reached it would be served before another tenant's requests that came a moment
  later.
- `queue_tokens`: the tokens that may wait here for a slot. Past it a request is refused with a
  429 only when its tenant holds at least its share of the tokens here (what its admitted and
  waiting requests cost, against the mean over the tenants holding any): one tenant's flood
  fills the gate with 429s for itself, not for the others, which may go past the bound by at
  most one share.

Free slots go to the waiting tenants by weighted fair share in tokens (stride scheduling: a
tenant's pass advances cost / weight per request admitted, the tenant with the lowest pass
goes first, its requests in arrival order; a tenant that was idle starts at the current pass,
so idling banks no credit). That is the scheduler's unit, so the gate and the engine agree on
who is behind.

No Ray import and no engine: tests drive it with plain asyncio. Event loop only.
"""
from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from ..types import EngineError, GenerateRequest


def cost(req: GenerateRequest) -> int:
    """The tokens a request is charged: its prompt plus the tokens it may generate."""
    return len(req.prompt_token_ids) + req.params.max_tokens


@dataclass
class _Waiter:
    granted: asyncio.Future
    weight: float
    cost: int


@dataclass
class Admission:
    """The gate: `slots()` sequences past it at most, `queue_tokens()` tokens waiting at most."""

    slots: Callable[[], int]
    queue_tokens: Callable[[], int]
    running: int = 0  # sequences past the gate
    held: Counter[str] = field(default_factory=Counter)  # tenant -> tokens admitted or waiting
    waiting: dict[str, deque[_Waiter]] = field(default_factory=dict)
    queued_tokens: int = 0
    passes: dict[str, float] = field(default_factory=dict)  # tenant -> its virtual time (tokens)
    now: float = 0.0  # the pass of the last admission

    @asynccontextmanager
    async def hold(self, tenant: str, weight: float, tokens: int) -> AsyncIterator[None]:
        """Hold a slot (and `tokens` of `tenant`'s share) while the block runs; waits for one
        at capacity, or raises the 429."""
        await self._acquire(tenant, weight, tokens)
        try:
            yield
        finally:
            self._release(tenant, tokens)

    def queued(self) -> int:
        """Requests waiting for a slot."""
        return sum(len(q) for q in self.waiting.values())

    def in_flight(self) -> int:
        """Requests past the gate or waiting at it."""
        return self.running + self.queued()

    # -- inside --------------------------------------------------------------------------------
    async def _acquire(self, tenant: str, weight: float, tokens: int) -> None:
        if self.running < self.slots() and not self.waiting:
            self.held[tenant] += tokens
            self._admit(tenant, weight, tokens)
            return
        if self.queued_tokens + tokens > self.queue_tokens() and self._over_share(tenant):
            raise EngineError(f"the server is at capacity ({self.running} sequences running, "
                              f"{self.queued_tokens} tokens queued; your share of them is held); "
                              "retry later", status=429, code="rate_limit_exceeded")
        waiter = _Waiter(asyncio.get_running_loop().create_future(), weight, tokens)
        self.waiting.setdefault(tenant, deque()).append(waiter)
        self.queued_tokens += tokens
        self.held[tenant] += tokens
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted as it was cancelled
                self._release(tenant, tokens)
            else:
                self._forget(tenant, waiter)
            raise

    def _over_share(self, tenant: str) -> bool:
        """Whether `tenant` holds at least the mean of the tokens held here per tenant (any
        tenant does while none holds any)."""
        return self.held[tenant] * len(self.held) >= sum(self.held.values())

    def _admit(self, tenant: str, weight: float, tokens: int) -> None:
        start = max(self.passes.get(tenant, self.now), self.now)
        self.now = start
        self.passes[tenant] = start + tokens / weight
        self.running += 1

    def _release(self, tenant: str, tokens: int) -> None:
        self.running -= 1
        self._unhold(tenant, tokens)
        self._grant()

    def _unhold(self, tenant: str, tokens: int) -> None:
        self.held[tenant] -= tokens
        if not self.held[tenant]:  # `held` names the tenants holding any
            del self.held[tenant]

    def _grant(self) -> None:
        """Hand free slots to the waiting tenants with the lowest pass."""
        while self.running < self.slots() and self.waiting:
            tenant = min(self.waiting, key=lambda t: (max(self.passes.get(t, self.now), self.now), t))
            queue = self.waiting[tenant]
            waiter = queue.popleft()
            if not queue:
                del self.waiting[tenant]
            self.queued_tokens -= waiter.cost
            if waiter.granted.cancelled():
                self._unhold(tenant, waiter.cost)
                continue
            self._admit(tenant, waiter.weight, waiter.cost)
            waiter.granted.set_result(None)

    def _forget(self, tenant: str, waiter: _Waiter) -> None:
        """A request that gave up waiting (its client went away): its place and tokens."""
        queue = self.waiting.get(tenant)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        if not queue:
            del self.waiting[tenant]
        self.queued_tokens -= waiter.cost
        self._unhold(tenant, waiter.cost)
