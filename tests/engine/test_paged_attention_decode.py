"""A decode step whose mask is all True calls SDPA with no mask (`PagedAttention.full`), and
gives what the masked call gives; a step where one sequence is shorter keeps its mask."""
from __future__ import annotations

import torch

from loraserve.engine.core.attention import KVCache, PagedAttention

HQ, HKV, D, BS = 4, 2, 8, 4


def _step(cache: KVCache, tables: list[list[int]], ends: list[int]) -> PagedAttention:
    return PagedAttention.build(cache, tables, [e - 1 for e in ends], ends, torch.device("cpu"))


def test_full_decode_step_needs_no_mask_and_gives_the_masked_result():
    cache = KVCache(1, 8, BS, HKV, D, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    tables = [[3, 1], [0, 5]]
    q = torch.randn(2, HQ, D, generator=g)
    k, v = torch.randn(2, HKV, D, generator=g), torch.randn(2, HKV, D, generator=g)
    equal = _step(cache, tables, [7, 7])
    assert equal.full and equal.single_query and bool(equal.mask.all())
    unmasked = equal(0, q, k, v)
    equal.full = False  # the same step through the masked call
    assert torch.allclose(unmasked, equal(0, q, k, v), atol=1e-6, rtol=0)
    ragged = _step(cache, tables, [7, 5])
    assert not ragged.full and not bool(ragged.mask.all())
    # the shorter sequence's answer is its own: the same as that sequence alone
    alone = _step(cache, tables[1:], [5])
    assert alone.full
    assert torch.allclose(ragged(0, q, k, v)[1], alone(0, q[1:], k[1:], v[1:])[0], atol=1e-6, rtol=0)


def test_one_sequence_in_consecutive_blocks_reads_a_slice_and_gives_what_the_gather_gives():
    """`PagedAttention.kv_run`: one sequence whose context lies in consecutive blocks attends to
    a view of the cache; scattered blocks, padding or a second sequence gather as before."""
    cache = KVCache(2, 8, BS, HKV, D, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    for ends, table in (([7], [2, 3]), ([8], [2, 3]), ([3], [5]), ([9], [4, 5, 6]), ([1], [0])):
        q = torch.randn(1, HQ, D, generator=g)
        k, v = torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
        run = _step(cache, [table], ends)
        assert run.kv_run == (table[0] * BS, table[0] * BS + ends[0])
        saved = cache.k.clone(), cache.v.clone()
        got = run(1, q, k, v)
        cache.k.copy_(saved[0]), cache.v.copy_(saved[1])
        run.kv_run = None  # the same step through the gather
        assert torch.equal(got, run(1, q, k, v))
    assert _step(cache, [[3, 1]], [7]).kv_run is None            # blocks not consecutive
    assert _step(cache, [[1, 2], [3, 4]], [7, 7]).kv_run is None  # two sequences
    padded = PagedAttention.build(cache, [[1, 2]], [6], [7], torch.device("cpu"), context=8)
    assert padded.kv_run is None                                  # a compiled bucket's padding
