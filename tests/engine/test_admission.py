"""Admission in tokens (engine/client/admission.py), the one gate every hosting's frontend passes
a request through: free slots go to tenants by weighted fair share in tokens, the queue is
bounded in tokens, and a full queue refuses only a tenant that holds its share. Plain asyncio."""
from __future__ import annotations

import asyncio

import pytest

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
