"""Tenants' fair shares across the engine replicas, kept at the ingress (every request passes it).

Each replica's scheduler shares *its* batch among the tenants it sees, by weight. That alone
does not share the cluster: a tenant's burst that fills every replica's queue in Serve's router
(FIFO there) is served before another tenant's requests that came a moment later, whichever
replica they would go to. So the ingress admits sequences to the engine deployment only while
the cluster has running slots (live replicas x --max-batch-size); past that they wait here,
one FIFO per tenant, and each slot that frees goes to the waiting tenant with the least
weighted service so far (stride scheduling: a tenant's pass advances 1 / weight per sequence
admitted, and a tenant that was idle starts from the current pass, so idling banks no credit).
Past `max_waiting` sequences waiting, a request gets the 429 Serve's full queue would give.

No Ray import: the ingress's frontend uses it, and tests drive it with plain asyncio.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from ..engine.types import EngineError


class FairGate:
    """Cluster-wide weighted fair admission of engine sequences. Event loop only."""

    def __init__(self, capacity: Callable[[], int], max_waiting: Callable[[], int]):
        self.capacity = capacity        # running slots of the live replicas
        self.max_waiting = max_waiting  # sequences that may wait here
        self.running = 0
        self.waiting: dict[str, deque[tuple[asyncio.Future, float]]] = {}
        self.passes: dict[str, float] = {}  # tenant -> its virtual time
        self.now = 0.0                      # the pass of the last admission

    @asynccontextmanager
    async def slot(self, tenant: str, weight: float) -> AsyncIterator[None]:
        """Hold one running slot for a sequence of `tenant` while the block runs."""
        await self._acquire(tenant, weight)
        try:
            yield
        finally:
            self.running -= 1
            self._grant()

    def queued(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    async def _acquire(self, tenant: str, weight: float) -> None:
        if self.running < self.capacity() and not self.queued():
            self._admit(tenant, weight)
            return
        if self.queued() >= self.max_waiting():
            raise EngineError("the server is at capacity (every engine replica's queue is "
                              "full); retry later", status=429, code="rate_limit_exceeded")
        granted = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(tenant, deque()).append((granted, weight))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled
                self.running -= 1
                self._grant()
            else:
                self._forget(tenant, granted)
            raise

    def _admit(self, tenant: str, weight: float) -> None:
        start = max(self.passes.get(tenant, self.now), self.now)
        self.now = start
        self.passes[tenant] = start + 1.0 / weight
        self.running += 1

    def _grant(self) -> None:
        """Hand free slots to the waiting tenants with the lowest pass."""
        while self.running < self.capacity():
            tenants = [t for t, q in self.waiting.items() if q]
            if not tenants:
                return
            tenant = min(tenants, key=lambda t: (max(self.passes.get(t, self.now), self.now), t))
            granted, weight = self.waiting[tenant].popleft()
            if not self.waiting[tenant]:
                del self.waiting[tenant]
            if granted.cancelled():
                continue
            self._admit(tenant, weight)
            granted.set_result(None)

    def _forget(self, tenant: str, granted: asyncio.Future) -> None:
        queue = self.waiting.get(tenant)
        if queue is None:
            return
        self.waiting[tenant] = deque(item for item in queue if item[0] is not granted)
        if not self.waiting[tenant]:
            del self.waiting[tenant]
