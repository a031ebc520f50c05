"""`sources.SingleFlight`: concurrent callers of one key share one run; a caller that comes just
after a run ended starts none when the work is `settled` (the race that made
tests/server/test_s3_store.py's burst count two fault-ins for four concurrent misses on a busy
machine: the fourth request reached the flight after the first had landed)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from loraserve.catalog.sources import SingleFlight


def test_a_late_caller_starts_nothing_once_the_work_is_settled() -> None:
    flight, landed = SingleFlight(), []
    flight.run("k", lambda: landed.append("k"), settled=lambda: "k" in landed)
    assert flight.run("k", lambda: landed.append("again"), settled=lambda: "k" in landed) is None
    assert landed == ["k"] and flight.started == 1


def test_without_settled_or_when_unsettled_a_late_caller_runs_again() -> None:
    flight, runs = SingleFlight(), []
    flight.run("k", lambda: runs.append(1))
    flight.run("k", lambda: runs.append(2))
    flight.run("k", lambda: runs.append(3), settled=lambda: False)
    assert runs == [1, 2, 3] and flight.started == 3


def test_settled_is_not_asked_while_a_flight_runs() -> None:
    """A follower joins the running flight and gets its result, whatever `settled` would say."""
    flight, gate, asked = SingleFlight(), threading.Event(), []

    def settled() -> bool:
        asked.append(1)
        return False

    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(flight.run, "k", lambda: gate.wait(10) and "led", settled)
        while flight.started == 0:
            pass
        follower = pool.submit(flight.run, "k", lambda: "second", settled)
        gate.set()
        assert leader.result() == "led"
        assert follower.result() in ("led", "second")  # joined, or came after it ended
    assert len(asked) == 1 + (follower.result() == "second")
