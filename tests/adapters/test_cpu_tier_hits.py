"""Every CPU-tier hit is counted once: `AdapterManager.try_acquire` loading a cached revision into
the device pool counts it (it read the cache without counting, so the hit ratio said 0% while
the tier served), a refused load (pool full) counts nothing until the retry that loads it, and
weights paged in from disk for the request are the fetch's miss, not a hit. A seeded random walk
checks the count against a model of the tiers, and that every CPU-tier hit is also timed:
`loraserve_adapter_page_in_seconds_count{source="cpu"}` equals the hit count (issue 43: it said 0
with 955 hits, so the report's CPU page-in chart was flat)."""
from __future__ import annotations

import random

import pytest
from adapter_fakes import FINGERPRINT

from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.manager import AdapterManager
from loraserve.adapters.pager import Pager
from loraserve.adapters.pool import PoolFull


def page_ins(pager: Pager, source: str) -> tuple[float, float]:
    """(count, sum) of the pager's page-in histogram for `source`."""
    got = {(x.name, x.labels.get("source")): x.value for m in pager.page_in_seconds.collect()
           for x in m.samples}
    return (got[("loraserve_adapter_page_in_seconds_count", source)],
            got[("loraserve_adapter_page_in_seconds_sum", source)])


class FakePool:
    """The pool's part try_acquire uses: `slots` places; `full` refuses every load."""

    def __init__(self, slots: int = 2) -> None:
        self.config = type("Config", (), {"max_slots": slots})()
        self.slots = slots
        self.loaded: dict = {}
        self.full = False

    def __contains__(self, key) -> bool:
        return key in self.loaded

    def slot_of(self, key):
        return self.loaded.get(key)

    def load(self, key, weights) -> None:
        if self.full or len(self.loaded) >= self.slots:
            raise PoolFull("no room")
        self.loaded[key] = len(self.loaded)

    def acquire(self, key) -> int:
        return self.loaded[key]

    def evict(self, key) -> None:
        self.loaded.pop(key, None)


class Weights:
    """Just enough of AdapterWeights for the CPU cache's byte count."""

    tensors: dict = {}


@pytest.fixture()
def tiers():
    cache = CpuCache(1 << 20)
    with Pager(None, cache, FINGERPRINT, workers=1) as pager:
        pool = FakePool()
        yield AdapterManager(None, pool, cache, pager, FINGERPRINT), pool, cache, pager


def test_a_cpu_hit_is_counted_once_when_it_loads(tiers) -> None:
    manager, pool, cache, pager = tiers
    key = ("acme/a", "r1")
    cache.put(key, Weights())
    assert manager.tier_of(key) == "cpu"
    pool.full = True
    assert manager.try_acquire(key) is None and manager.try_acquire(key) is None
    assert pager.stats.cpu_hits == 0  # not served yet
    pool.full = False
    assert manager.try_acquire(key) == 0
    assert pager.stats.cpu_hits == 1 and page_ins(pager, "cpu")[0] == 1
    assert page_ins(pager, "cpu")[1] > 0  # timed: the copy into the pool took some time
    assert manager.tier_of(key) == "device"
    assert manager.try_acquire(key) == 0  # a device hit now: the CPU tier is not asked
    assert pager.stats.cpu_hits == 1


def test_staged_weights_are_not_cpu_hits(tiers) -> None:
    manager, pool, cache, pager = tiers
    key = ("acme/b", "r1")
    assert manager.tier_of(key) == "catalog"
    manager.settle(key, Weights())  # a page-in from disk landed for a parked request
    assert manager.tier_of(key) == "cpu"
    assert manager.try_acquire(key) == 0
    assert pager.stats.cpu_hits == 0 and page_ins(pager, "cpu")[0] == 0


def test_random_walk_counts_every_cpu_tier_load() -> None:
    rng = random.Random(23)
    cache = CpuCache(1 << 20, max_entries=3)
    with Pager(None, cache, FINGERPRINT, workers=1) as pager:
        pool = FakePool(slots=2)
        manager = AdapterManager(None, pool, cache, pager, FINGERPRINT)
        keys = [(f"acme/a{i}", "r1") for i in range(6)]
        expected = 0
        for _ in range(400):
            key, op = rng.choice(keys), rng.random()
            if op < 0.3:
                cache.put(key, Weights())
            elif op < 0.45:
                pool.evict(key)
            else:
                pool.full = rng.random() < 0.2
                from_cpu = key not in pool and key in cache and not pool.full \
                    and len(pool.loaded) < pool.slots
                slot = manager.try_acquire(key)
                expected += from_cpu
                assert (slot is not None) == (key in pool)
            assert len(cache) <= 3  # the count bound (--max-cpu-loras) holds throughout
            assert pager.stats.cpu_hits == expected == page_ins(pager, "cpu")[0]
            if rng.random() < 0.1:  # a fetch served by the CPU tier is a hit, timed, too
                hit = rng.choice(keys)
                if hit in cache:
                    record = type("Record", (), {"adapter_id": hit[0], "revision": hit[1]})()
                    assert pager.fetch(record).done()
                    expected += 1
        assert expected > 10 and page_ins(pager, "cpu")[0] == pager.stats.cpu_hits


def test_the_entry_bound_evicts_least_recently_used() -> None:
    cache = CpuCache(1 << 20, max_entries=2)
    for name in ("a", "b"):
        cache.put((name, "r1"), Weights())
    assert cache.get(("a", "r1")) is not None  # a is now the most recent
    cache.put(("c", "r1"), Weights())
    assert cache.keys() == [("a", "r1"), ("c", "r1")]
    assert cache.stats.evictions == 1
    with pytest.raises(ValueError):
        CpuCache(1 << 20, max_entries=0)
