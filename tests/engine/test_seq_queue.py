"""The scheduler's queues (`SeqQueue`, O(1) per operation) against a plain list as the
reference model, over random operation sequences; and the scheduler's books over random
add / park / unpark / step / abort sequences: every sequence in exactly one place with its
status, the per-tenant counts what the queues hold, the KV blocks balanced."""
from __future__ import annotations

import bisect
import collections

import pytest
from hypothesis import given, settings, strategies as st

from loraserve.engine.core.block_manager import BlockManager
from loraserve.engine.core.scheduler import Scheduler
from loraserve.engine.core.seq_queue import SeqQueue
from loraserve.engine.core.sequence import SeqStatus, Sequence
from loraserve.engine.types import SamplingParams
from test_scheduler import _step

OPS = ("append", "appendleft", "insert_by_arrival", "remove", "discard_absent", "first", "last")


def _seq(n: int, arrival: float, prompt: int = 3, max_tokens: int = 2, tenant: str = "") -> Sequence:
    seq = Sequence(f"s{n}", [1000 * n + i for i in range(prompt)],
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   tenant=tenant)
    seq.arrival = arrival
    return seq


def _model_insert_by_arrival(model: list[Sequence], seq: Sequence) -> None:
    """The reference: after the last member that arrived no later than seq."""
    at = len(model)
    while at and model[at - 1].arrival > seq.arrival:
        at -= 1
    arrivals = [s.arrival for s in model]
    if arrivals == sorted(arrivals):  # where the queue is in arrival order, as bisect put it
        assert at == bisect.bisect_right(arrivals, seq.arrival)
    model.insert(at, seq)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000), st.integers(0, 6)),
                max_size=60))
def test_the_queue_matches_a_list(ops) -> None:
    queue, model, made = SeqQueue(), [], 0
    for op, pick, arrival in ops:
        if op in ("append", "appendleft", "insert_by_arrival"):
            seq, made = _seq(made, float(arrival)), made + 1
            getattr(queue, op)(seq)
            if op == "append":
                model.append(seq)
            elif op == "appendleft":
                model.insert(0, seq)
            else:
                _model_insert_by_arrival(model, seq)
        elif op == "remove" and model:
            seq = model.pop(pick % len(model))
            queue.remove(seq)
            assert seq not in queue
        elif op == "discard_absent":
            assert not queue.discard(_seq(made, 0.0))
            with pytest.raises(ValueError, match="not in the queue"):
                queue.remove(_seq(made, 0.0))
        elif op in ("first", "last"):
            if model:
                assert getattr(queue, op)() is model[0 if op == "first" else -1]
            else:
                with pytest.raises(IndexError):
                    getattr(queue, op)()
        assert list(queue) == model and len(queue) == len(model) and bool(queue) == bool(model)
        assert all(s in queue for s in model)


def test_a_sequence_is_queued_once() -> None:
    seq = _seq(0, 0.0)
    queue = SeqQueue([seq])
    with pytest.raises(ValueError, match="already in the queue"):
        queue.appendleft(seq)
    assert list(queue) == [seq]


def _check_books(sched: Scheduler, live: list[Sequence]) -> None:
    """Every live sequence in exactly one place, with that place's status; the tenant counts
    the scheduler keeps are what its queues hold; the KV blocks balance."""
    places = {"waiting": list(sched.waiting), "running": list(sched.running),
              "parked": list(sched.parked.values())}
    status = {"waiting": SeqStatus.WAITING, "running": SeqStatus.RUNNING,
              "parked": SeqStatus.PARKED}
    seen = [s for seqs in places.values() for s in seqs]
    assert sorted(s.request_id for s in seen) == sorted(s.request_id for s in live)
    for place, seqs in places.items():
        assert all(s.status is status[place] for s in seqs), place
    assert sched._queued == dict(collections.Counter(s.tenant for s in places["waiting"]))
    assert sched._active == dict(collections.Counter(
        s.tenant for s in places["waiting"] + places["running"]))
    sched.blocks.check_invariants(places["running"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("add", "park", "unpark", "step", "step", "abort")),
                          st.integers(0, 1000), st.integers(1, 8)), max_size=50))
def test_the_scheduler_books_balance_over_random_operations(ops) -> None:
    # 16 tokens of KV cache and a budget of 8: chunked prefills and preemptions are common
    sched = Scheduler(BlockManager(8, 2), max_batch_size=4, max_batched_tokens=8)
    live: list[Sequence] = []
    for n, (op, pick, size) in enumerate(ops):
        if op in ("add", "park"):
            seq = _seq(n, float(pick), prompt=size, max_tokens=1 + pick % 6,
                       tenant="AB"[pick % 2])
            live.append(seq)
            sched.add(seq) if op == "add" else sched.park(seq)
        elif op == "unpark" and sched.parked:
            parked = list(sched.parked.values())
            sched.unpark(parked[pick % len(parked)])
        elif op == "step":
            _step(sched)  # the engine's part: tokens computed, finished sequences removed
            live = [s for s in live if not s.is_finished]
        elif op == "abort" and live:
            seq = live.pop(pick % len(live))
            sched.remove(seq)
            assert seq.is_finished and not seq.block_table
        _check_books(sched, live)
