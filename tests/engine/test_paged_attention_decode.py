"""A decode step whose mask is all True calls SDPA with no mask (`PagedAttention.full`), and
gives what the masked call gives; a step where one sequence is shorter keeps its mask. A
compiled CPU step attends with plain ops (`_decode_attention`) and writes K/V in place."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.engine.core.attention import KVCache, PagedAttention, _decode_attention

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


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_decode_attention_of_a_compiled_step_equals_sdpa(data):
    """`_decode_attention` (a compiled CPU step's attention) against SDPA with `enable_gqa`:
    generated batch, head grouping, context width and masks (each query sees at least one
    position); Inf in the K of masked positions changes nothing."""
    b, kv_heads = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    rep, c = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(b, kv_heads * rep, 1, D, generator=g)
    k, v = torch.randn(b, kv_heads, c, D, generator=g), torch.randn(b, kv_heads, c, D, generator=g)
    mask = torch.rand(b, 1, 1, c, generator=g) < 0.6
    mask[torch.arange(b), 0, 0, torch.randint(0, c, (b,), generator=g)] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)
    k = k.masked_fill(~mask.view(b, 1, c, 1), float("inf"))
    torch.testing.assert_close(_decode_attention(q, k, v, mask), want, rtol=1e-5, atol=1e-5)
    bf = _decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert bf.dtype == torch.bfloat16 and torch.allclose(bf.float(), want, atol=3e-2, rtol=3e-2)


def test_a_compiled_step_writes_k_v_in_place_and_copies_no_cache():
    """Under torch.compile the K/V write is an in-place scatter: the step's rows land in the
    cache's own storage, and the generated code allocates no buffer the size of a layer's cache
    (a functional update of the cache would copy all of it every step)."""
    from torch._inductor.utils import run_and_get_code

    cache = KVCache(3, 6, BS, HKV, D, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    step = _step(cache, [[4, 1]], [6])
    q = torch.randn(1, HQ, D, generator=g)
    k, v = torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
    before, storage = cache.k.clone(), cache.k.untyped_storage().data_ptr()
    want = step(2, q, k, v)
    cache.k.copy_(before)
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(lambda q, k, v: step(2, q, k, v)), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    slot = int(step.slot_mapping[0])
    assert torch.equal(cache.k[2, slot], k[0]) and torch.equal(cache.v[2, slot], v[0])
    assert cache.k.untyped_storage().data_ptr() == storage
    layer_cache = f"({cache.k.shape[1]}, {HKV}, {D})"
    assert not any(f"empty_strided_cpu({shape}" in src for src in code
                   for shape in (layer_cache, str(tuple(cache.k.shape)))), "the compiled step copies the cache"


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_decode_step_builds_the_tensors_the_general_build_makes(data):
    """`PagedAttention.build` of a decode step (one token a sequence) takes `_build_decode`: every
    field equal to the general form's, ragged lengths, scattered and padded block tables, a
    fixed context width (a compiled bucket) or none."""
    cache = KVCache(1, 16, BS, HKV, D, torch.float32, torch.device("cpu"))
    b = data.draw(st.integers(1, 5))
    ends = [data.draw(st.integers(1, 4 * BS)) for _ in range(b)]
    tables = []
    for e in ends:
        need = -(-e // BS) + data.draw(st.integers(0, 2))  # a table may hold blocks past its end
        tables.append(data.draw(st.lists(st.integers(0, 15), min_size=need, max_size=need)))
    context = data.draw(st.none() | st.integers(max(ends), max(ends) + 2 * BS))
    starts = [e - 1 for e in ends]
    fast = PagedAttention.build(cache, tables, starts, ends, torch.device("cpu"), context=context)
    slow = PagedAttention._build_general(cache, tables, starts, ends, torch.device("cpu"), context=context)
    for name in ("slot_mapping", "q_index", "q_valid_pos", "kv_index", "mask", "lens"):
        got, want = getattr(fast, name), getattr(slow, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    same = ("shape", "single_query", "full", "kv_run")
    assert [getattr(fast, n) for n in same] == [getattr(slow, n) for n in same]
    for window in (1, 3):
        assert torch.equal(fast.window_mask(window), slow.window_mask(window))
