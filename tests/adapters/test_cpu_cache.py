"""CpuCache: byte bound, LRU order, oversize entries, stats."""
import threading

import pytest
import torch
from adapter_fakes import make_weights, tiny_specs
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.weights import weights_nbytes

SPECS = tiny_specs()


def weights_of(rank: int, seed: int = 0):
    return make_weights(SPECS, rank, ["q_proj"], seed=seed)  # 2 layers * 2 * 8 * rank * 4 bytes


def test_get_put_hits_misses_and_lru_order():
    one = weights_nbytes(weights_of(1))
    cache = CpuCache(max_bytes=3 * one)
    assert cache.get(("t/a", "r")) is None
    for name in "abc":
        assert cache.put((f"t/{name}", "r"), weights_of(1))
    assert cache.get(("t/a", "r")) is not None  # a is now most recent; b is LRU
    cache.put(("t/d", "r"), weights_of(1))
    assert cache.keys() == [("t/c", "r"), ("t/a", "r"), ("t/d", "r")]
    assert cache.recent(2) == [("t/d", "r"), ("t/a", "r")]  # most recent first, as keys() reversed
    assert cache.recent(9) == cache.keys()[::-1] and cache.recent(0) == []
    assert ("t/b", "r") not in cache
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.evictions, stats.entries, stats.bytes) == (1, 1, 1, 3, 3 * one)


def test_a_big_entry_evicts_as_many_as_needed():
    one, big = weights_nbytes(weights_of(1)), weights_nbytes(weights_of(3))
    cache = CpuCache(max_bytes=big + one)  # room for one small entry beside the big one
    for name in "abcd":
        cache.put((f"t/{name}", "r"), weights_of(1))
    cache.put(("t/big", "r"), weights_of(3))
    assert cache.keys() == [("t/d", "r"), ("t/big", "r")]
    assert cache.stats.bytes == big + one and cache.stats.evictions == 3


def test_an_entry_larger_than_the_cache_is_not_kept():
    cache = CpuCache(max_bytes=weights_nbytes(weights_of(3)) - 1)
    cache.put(("t/a", "r"), weights_of(1))
    assert not cache.put(("t/huge", "r"), weights_of(3))
    assert ("t/huge", "r") not in cache and ("t/a", "r") in cache
    assert cache.stats.rejected == 1 and cache.stats.evictions == 0
    assert not CpuCache(max_bytes=0).put(("t/a", "r"), weights_of(1))


def test_reputting_a_key_does_not_double_count_and_discard_frees():
    cache = CpuCache(max_bytes=10_000)
    cache.put(("t/a", "r"), weights_of(2))
    cache.put(("t/a", "r"), weights_of(2))
    assert cache.stats.bytes == weights_nbytes(weights_of(2)) and len(cache) == 1
    assert cache.discard(("t/a", "r")) and not cache.discard(("t/a", "r"))
    assert cache.stats.bytes == 0 and cache.stats.evictions == 0


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        CpuCache(max_bytes=-1)
    if torch.cuda.is_available():
        cache = CpuCache(max_bytes=1 << 20, pin_memory=True)
        cache.put(("t/a", "r"), weights_of(1))
        assert all(t.is_pinned() for t in cache.get(("t/a", "r")).tensors.values())
    else:
        with pytest.raises(ValueError, match="needs CUDA"):
            CpuCache(max_bytes=1 << 20, pin_memory=True)


@settings(max_examples=40, deadline=None)
@given(cap_ranks=st.integers(0, 12),
       ops=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8), st.booleans()), max_size=40))
def test_random_workload_never_exceeds_the_byte_bound(cap_ranks, ops):
    cap = cap_ranks * weights_nbytes(weights_of(1))
    cache = CpuCache(max_bytes=cap)
    for i, rank, is_put in ops:
        key = (f"t/a{i}", "r")
        if is_put:
            kept = cache.put(key, weights_of(rank))
            assert kept == (weights_nbytes(weights_of(rank)) <= cap) and (key in cache) == kept
        else:
            got = cache.get(key)
            assert got is None or got.rank >= 1
        stats = cache.stats
        assert stats.bytes <= cap
        assert stats.bytes == sum(weights_nbytes(cache.get(k)) for k in cache.keys())


def test_concurrent_puts_and_gets_keep_the_bound():
    cap = 5 * weights_nbytes(weights_of(1))
    cache = CpuCache(max_bytes=cap)
    payload = [weights_of(r) for r in (1, 2, 3)]

    def work(worker: int) -> None:
        for i in range(200):
            key = (f"t/a{(worker * 7 + i) % 11}", "r")
            if i % 3:
                cache.put(key, payload[i % 3])
            else:
                cache.get(key)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.stats.bytes <= cap
    assert cache.stats.bytes == sum(weights_nbytes(cache.get(k)) for k in cache.keys())
