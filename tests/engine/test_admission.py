"""Admission in tokens (engine/client/admission.py), the one gate every hosting's frontend passes
a request through: free slots go to tenants by weighted fair share in tokens, the queue is
bounded in tokens, and a full queue refuses only a tenant that holds its share. Plain asyncio."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import combinations

import pytest
from hypothesis import given, settings, strategies as st

from loraserve.engine.client.admission import Admission, cost
from loraserve.engine.types import EngineError, GenerateRequest, SamplingParams

COST = 10


def _gate_order(slots: int, arrivals: list[tuple[str, float, int]], queue_tokens: int = 10_000) -> list[str]:
    """Tenants in the order their requests got a slot: `slots` slots held by "x" first, then
    `arrivals` (tenant, weight, tokens) queue, then slots free one at a time (each admitted
    request ends at once)."""

    async def run() -> list[str]:
        gate = Admission(lambda: slots, lambda: queue_tokens)
        order: list[str] = []
        release = asyncio.Event()

        async def seq(tenant: str, weight: float, tokens: int, hold: bool) -> None:
            async with gate.hold(tenant, weight, tokens):
                order.append(tenant)
                if hold:
                    await release.wait()

        holders = [asyncio.create_task(seq("x", 1.0, COST, True)) for _ in range(slots)]
        await asyncio.sleep(0)
        waiters = []
        for tenant, weight, tokens in arrivals:
            waiters.append(asyncio.create_task(seq(tenant, weight, tokens, False)))
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*holders, *waiters)
        assert (gate.running, gate.held, gate.queued_tokens) == (0, {}, 0)
        return order[slots:]

    return asyncio.run(run())


def test_a_request_costs_its_prompt_and_max_tokens() -> None:
    req = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=7))
    assert cost(req) == 10


def test_the_gate_admits_at_once_under_capacity() -> None:
    assert _gate_order(2, []) == []

    async def run() -> int:
        gate = Admission(lambda: 2, lambda: 0)
        async with gate.hold("a", 1.0, COST), gate.hold("b", 1.0, COST):
            return gate.running

    assert asyncio.run(run()) == 2


def test_a_later_tenant_is_not_served_after_a_whole_burst() -> None:
    """Tenant a queues 8 requests, then b queues 2: b's go second and fourth, not last (a FIFO
    across the cluster, as Serve's router queue is, would serve them 9th and 10th)."""
    order = _gate_order(1, [("a", 1.0, COST)] * 8 + [("b", 1.0, COST)] * 2)
    assert order[:4] == ["a", "b", "a", "b"] and order.count("a") == 8, order


def test_free_slots_follow_the_weights() -> None:
    order = _gate_order(1, [("a", 1.0, COST)] * 6 + [("b", 2.0, COST)] * 6)
    assert order[:6].count("b") == 4 and order[:6].count("a") == 2, order


def test_the_share_is_counted_in_tokens_not_requests() -> None:
    """a's requests cost 10 times b's: after a's first, b's next ten go before a's second (in
    requests, they would alternate)."""
    order = _gate_order(1, [("a", 1.0, 10 * COST)] * 3 + [("b", 1.0, COST)] * 12)
    assert order[:12] == ["a", *["b"] * 10, "a"], order


def test_a_full_queue_refuses_the_tenant_holding_its_share_only() -> None:
    """One slot, a queue of one request's tokens: a holds the slot, b waits; a second request of
    a (at its share) is a 429, one of c (nothing held) waits past the bound; a cancelled wait
    gives its place and tokens back."""

    async def run() -> tuple[int, str, int, int, dict]:
        gate = Admission(lambda: 1, lambda: COST)
        hold = asyncio.Event()

        async def seq(tenant: str) -> None:
            async with gate.hold(tenant, 1.0, COST):
                await hold.wait()

        first = asyncio.create_task(seq("a"))
        await asyncio.sleep(0)
        queued = asyncio.create_task(seq("b"))
        await asyncio.sleep(0)
        with pytest.raises(EngineError) as full:
            await seq("a")
        light = asyncio.create_task(seq("c"))
        await asyncio.sleep(0)
        waiting = gate.queued()
        queued.cancel()  # a client gone while waiting: its place is given up
        await asyncio.gather(queued, return_exceptions=True)
        held = dict(gate.held)
        hold.set()
        await asyncio.gather(first, light)
        return full.value.status, full.value.code, waiting, gate.running, held

    status, code, waiting, running, held = asyncio.run(run())
    assert (status, code, waiting, running) == (429, "rate_limit_exceeded", 2, 0)
    assert held == {"a": COST, "c": COST}


# -- the gate driven by hand: slots freed one or a few at a time, grants recorded ----------------

@dataclass
class _Recorded(Admission):
    """The gate, recording each admission: its tenant, tokens, and the tenants waiting at that
    moment (itself included: it was waiting, or came to a gate with nobody waiting)."""

    grants: list[tuple[str, int, frozenset[str]]] = field(default_factory=list)

    def _admit(self, tenant: str, weight: float, tokens: int) -> None:
        self.grants.append((tenant, tokens, frozenset(self.waiting) | {tenant}))
        super()._admit(tenant, weight, tokens)


class _Clients:
    """Requests at a gate, each running past it until the test ends it (a sequence finishing on
    a replica frees its slot)."""

    def __init__(self, gate: Admission):
        self.gate = gate
        self.running: list[asyncio.Event] = []  # past the gate, in the order they got there
        self.tasks: list[asyncio.Task] = []

    async def _request(self, tenant: str, weight: float, tokens: int) -> None:
        end = asyncio.Event()
        async with self.gate.hold(tenant, weight, tokens):
            self.running.append(end)
            await end.wait()
        self.running.remove(end)

    async def arrive(self, tenant: str, weight: float, tokens: int) -> None:
        self.tasks.append(asyncio.create_task(self._request(tenant, weight, tokens)))
        await self._settle()

    async def end(self, picks: list[int]) -> None:
        """End the running requests at `picks` (positions, modulo how many run) together, then
        let the granted ones reach their slots."""
        live = [e for e in self.running if not e.is_set()]
        for i in picks:
            if live:
                live.pop(i % len(live)).set()
        await self._settle()

    async def drain(self) -> None:
        while any(not t.done() for t in self.tasks):
            await self.end([0] * len(self.running))
        await asyncio.gather(*self.tasks)

    async def _settle(self) -> None:
        """Until every request has reached the gate and every one granted has started (the
        gate acts synchronously; its waiters resume on later turns of the loop)."""
        for _ in range(1_000):
            live = sum(not e.is_set() for e in self.running)
            pending = sum(not t.done() for t in self.tasks)
            if live == self.gate.running and pending == live + self.gate.queued():
                return
            await asyncio.sleep(0)
        raise AssertionError("the gate did not settle")


@pytest.mark.parametrize("at_once", [1, 2])
def test_a_saturated_gate_grants_slots_as_they_free_by_weight(at_once: int) -> None:
    """The Ray ingress's case: 8 slots (two replicas' batches of 4) held by long streams, then
    12 requests of light (weight 1) and after them 12 of heavy (weight 3), all of one cost,
    wait. The slots free `at_once` at a time (one sequence ending; one on each of two
    replicas), every granted request holding its slot until freed in its turn: heavy gets 3 of
    every 4 grants (9 of the first 12, all 12 within the first 16); FIFO would grant light's 12
    first, equal weights would alternate."""

    async def run() -> list[str]:
        gate = _Recorded(lambda: 8, lambda: 1_000_000)
        clients = _Clients(gate)
        for _ in range(8):
            await clients.arrive("admin", 1.0, 4_030)
        for tenant, weight in (("light", 1.0), ("heavy", 3.0)):
            for _ in range(12):
                await clients.arrive(tenant, weight, 32)
        assert (gate.running, gate.queued()) == (8, 24)
        while gate.queued():
            await clients.end([0] * at_once)  # the oldest first, as a batch's sequences end
        await clients.drain()
        assert (gate.running, gate.held, gate.queued_tokens) == (0, {}, 0)
        return [tenant for tenant, _, _ in gate.grants[8:]]

    order = asyncio.run(run())
    assert sorted(order) == ["heavy"] * 12 + ["light"] * 12
    for n in (4, 8, 12, 16):
        assert order[:n].count("heavy") == 3 * n // 4, (n, order)


def _lag_bound_violations(grants: list[tuple[str, int, frozenset[str]]],
                          weights: dict[str, float]) -> list[tuple[str, str, float, float]]:
    """Pairs of tenants whose weighted service drifted apart past stride scheduling's bound.

    Over any run of consecutive grants at which tenants i and j both wait, the tokens granted
    to each divided by its weight may differ by at most cmax_i / w_i + cmax_j / w_j (cmax: a
    tenant's largest request): each tenant's pass stays within one request's stride of the
    gate's `now`, and only its own grants move it while it waits."""
    cmax = {t: max(c for g, c, _ in grants if g == t) for t in {g for g, _, _ in grants}}
    out = []
    for i, j in combinations(sorted(cmax), 2):
        bound = cmax[i] / weights[i] + cmax[j] / weights[j]
        lag, low, high = 0.0, 0.0, 0.0  # i's weighted service less j's, over the current run
        for tenant, tokens, backlog in [*grants, ("", 0, frozenset())]:
            if not {i, j} <= backlog:  # the run ends: its widest swing
                if high - low > bound * (1 + 1e-9):
                    out.append((i, j, high - low, bound))
                lag, low, high = 0.0, 0.0, 0.0
                continue
            if tenant in (i, j):
                lag += tokens / weights[i] if tenant == i else -tokens / weights[j]
            low, high = min(low, lag), max(high, lag)
    return out


_ops = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 3), st.integers(1, 300)),  # tenant, tokens
    st.tuples(st.just("end"), st.lists(st.integers(0, 63), min_size=1, max_size=3)))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(weights=st.lists(st.floats(0.25, 8.0), min_size=2, max_size=4),
       slots=st.integers(1, 8),
       burst=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300)),
                      min_size=16, max_size=60),
       ops=st.lists(_ops, max_size=120))
def test_backlogged_tenants_stay_within_a_bounded_lag_of_their_weights(
        weights: list[float], slots: int, burst: list[tuple[int, int]],
        ops: list[tuple]) -> None:
    """Random weights, costs, arrival orders (a burst, then arrivals among the releases) and
    release patterns (one to three running requests ending together, any of them): wherever
    two tenants both wait, their grants in tokens / weight stay within one largest request's
    stride of each other (FIFO or equal shares drift without bound); and the gate ends empty."""
    tenants = {f"t{k}": w for k, w in enumerate(weights)}
    names = list(tenants)

    async def run() -> _Recorded:
        gate = _Recorded(lambda: slots, lambda: 10**9)
        clients = _Clients(gate)
        for k, tokens in burst:
            t = names[k % len(names)]
            await clients.arrive(t, tenants[t], tokens)
        for op in ops:
            if op[0] == "arrive":
                t = names[op[1] % len(names)]
                await clients.arrive(t, tenants[t], op[2])
            else:
                await clients.end(op[1])
        await clients.drain()
        assert (gate.running, gate.held, gate.queued_tokens, gate.waiting) == (0, {}, 0, {})
        return gate

    gate = asyncio.run(run())
    assert len(gate.grants) == len(burst) + sum(op[0] == "arrive" for op in ops)
    assert not _lag_bound_violations(gate.grants, tenants)
