"""The store's maintenance lease (catalog/store_lease.py) against moto's S3 server: two compactors
(or GCs) cannot interleave. One holds it, the other is refused; racing takers get exactly one
winner (conditional PUTs); an expired lease is taken over, and the old holder stops before it
writes."""
from __future__ import annotations

import threading
import time

import pytest

from loraserve.catalog.store_lease import LeaseHeld, LeaseLost, StoreLease, maintenance
from loraserve.catalog.store_log import ChangeLog, compact
from loraserve.catalog.store_objects import ObjectStore

from s3_testing import moto_s3


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        server.client().create_bucket(Bucket="catalog")
        yield server


@pytest.fixture
def store(s3, request):
    return ObjectStore(f"s3://catalog/lease/{request.node.name}", timeout_s=5.0)


def log_entries(store: ObjectStore) -> list[str]:
    return store.log_after(store.key("log") + "/")


def write_log(store: ObjectStore, tmp_path, n: int) -> None:
    changes = ChangeLog(store, tmp_path / "cursor.json")
    for i in range(n):
        changes.append(f"acme/a{i}")


def test_a_second_compactor_is_refused_while_the_first_holds_the_lease(store, tmp_path, capsys):
    from loraserve.cli_catalog import run
    write_log(store, tmp_path, 3)
    with maintenance(store, "compact-log") as first:
        with pytest.raises(LeaseHeld, match="compact-log by .* holds the maintenance lease"):
            StoreLease(store, "store-gc").acquire()
        assert run(["catalog", "compact-log", "--store", store.uri, "--keep-s", "0"]) == 1
        assert "holds the maintenance lease" in capsys.readouterr().err
        assert len(log_entries(store)) == 3  # the refused one wrote nothing
        first.check()
    assert run(["catalog", "compact-log", "--store", store.uri, "--keep-s", "0"]) == 0  # released: at once
    assert "folded into the snapshot: 3" in capsys.readouterr().out and not log_entries(store)


def test_racing_takers_get_exactly_one_winner(store):
    for _ in range(4):
        leases = [StoreLease(store, f"job{i}") for i in range(2)]
        start, won = threading.Barrier(2), []

        def take(lease: StoreLease) -> None:
            start.wait()
            try:
                lease.acquire()
                won.append(lease)
            except LeaseHeld:
                pass
        threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        won[0].release()


class Clock:
    """A wall clock the test moves (the lease compares expiries against its holder's clock)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_an_expired_lease_is_taken_over_and_the_old_compactor_stops_before_writing(store, tmp_path):
    write_log(store, tmp_path, 4)
    clock = Clock()
    stalled = StoreLease(store, "compact-log", ttl_s=60.0, clock=clock)
    stalled.acquire()  # and never renewed: a compactor paused past its expiry
    clock.now += 61
    taker = StoreLease(store, "compact-log", ttl_s=60.0, clock=clock)
    taker.acquire()
    with pytest.raises(LeaseLost, match="taken over"):
        stalled.renew()
    with pytest.raises(LeaseLost):
        compact(store, keep_s=0.0, now_ns=time.time_ns() + 10**9, lease=stalled)
    assert len(log_entries(store)) == 4 and store.get_json(store.key("log-pruned.json")) is None
    assert compact(store, keep_s=0.0, now_ns=time.time_ns() + 10**9, lease=taker) == 4
    taker.release()


def test_a_renewed_lease_is_held_past_its_first_expiry_and_fences_once_late(store):
    clock = Clock()
    lease = StoreLease(store, "store-gc", ttl_s=60.0, clock=clock)
    lease.acquire()
    clock.now += 50
    lease.renew()  # what the renewing thread does every ttl_s / 3
    clock.now += 20  # past the first expiry, inside the renewed one
    with pytest.raises(LeaseHeld):
        StoreLease(store, "compact-log", clock=clock).acquire()
    lease.check()
    clock.now += 20  # less than half the lease left: the holder stops before its next write
    with pytest.raises(LeaseLost, match="not renewed in time"):
        lease.check()
    lease.release()
    StoreLease(store, "compact-log", clock=clock).acquire()  # released: taken at once
