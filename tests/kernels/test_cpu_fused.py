"""The fused CPU decode ops (loraserve.kernels.cpu_fused) against the torch formulas they replace.

Each op is drawn over shapes (every tail of a row, GQA groups, strided row views as the fused
q/k/v and gate/up outputs hand them over), dtypes (float32, bfloat16), thread counts 1 and 2
and, for attention, scattered cache slots, windows and ragged context lengths, and compared
with the model's own torch path: float32 to rounding, bfloat16 within a few ulps (the sums run
in another order). Where the library cannot build (no compiler) `available` is False and the
model keeps torch's ops; that fallback is what every other model test runs through then.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.kernels import cpu_fused
from loraserve.model.layers import rms_norm
from loraserve.model.rope import apply_rotary

pytestmark = pytest.mark.skipif(not shutil.which("c++") and not shutil.which("g++"),
                                reason="no C++ compiler: the fused ops cannot build here")

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def test_the_library_builds_with_a_compiler():
    assert cpu_fused.available()


def _rows(gen: torch.Generator, t: int, width: int, lo: int, n: int, dtype) -> torch.Tensor:
    """A [t, n] view of columns lo..lo+n of a wider [t, width] tensor (a fused output's slice)."""
    return torch.randn(t, width, generator=gen).to(dtype)[:, lo:lo + n]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), n=st.integers(1, 70), heads=st.integers(0, 4), extra=st.integers(0, 5),
       dtype=DTYPES, threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_rms_norm_equals_the_model_norm(t, n, heads, extra, dtype, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.set_num_threads(threads)
    if heads:  # [T, R, n] heads of a fused row (Qwen3's q/k norm), weight per head
        x = _rows(gen, t, heads * n + extra, extra, heads * n, dtype).unflatten(1, (heads, n))
        w = torch.randn(heads, n, generator=gen).to(dtype)
    else:
        x = _rows(gen, t, n + extra, extra, n, dtype)
        w = torch.randn(n, generator=gen).to(dtype)
    with torch.inference_mode():
        got, want = cpu_fused.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), n=st.integers(1, 70), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_add_rms_norm_equals_an_add_then_the_norm(t, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, d = (torch.randn(t, n, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(n, generator=gen).to(dtype)
    with torch.inference_mode():
        total, normed = cpu_fused.add_rms_norm(x, d, w, 1e-5)
        want = x + d
        torch.testing.assert_close(total, want, rtol=0, atol=0)
        torch.testing.assert_close(normed, rms_norm(want, w, 1e-5), **TOL[dtype])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(t=st.integers(1, 6), heads=st.integers(1, 5), half=st.integers(1, 40), extra=st.integers(0, 3),
       normed=st.booleans(), dtype=DTYPES, threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_rope_equals_apply_rotary(t, heads, half, extra, normed, dtype, threads, seed):
    from loraserve.model.rope import RotaryEmbedding
    gen = torch.Generator().manual_seed(seed)
    torch.set_num_threads(threads)
    d = 2 * half
    wide = torch.randn(t, (heads + extra) * d, generator=gen).to(dtype)
    x = wide[:, :heads * d].unflatten(1, (heads, d))
    cos, sin = RotaryEmbedding(d, 10000.0, None)(torch.randint(0, 4000, (t,), generator=gen), dtype)
    w = torch.randn(heads, d, generator=gen).to(dtype) if normed else None
    with torch.inference_mode():
        got = cpu_fused.rope(x, cos, sin, w, 1e-6)
        want = apply_rotary(rms_norm(x, w, 1e-6) if normed else x, cos, sin)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), n=st.integers(1, 100), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_silu_mul_equals_swiglu_on_a_fused_output(t, n, dtype, seed):
    """Every tail of the 16-lane vector loop (float32), large |x| (exp past its range) included."""
    gen = torch.Generator().manual_seed(seed)
    both = (4 * torch.randn(t, 2 * n, generator=gen)).to(dtype)
    g, u = both[:, :n], both[:, n:]
    with torch.inference_mode():
        torch.testing.assert_close(cpu_fused.silu_mul(g, u), F.silu(g) * u, **TOL[dtype])


def _attention_case(gen, b, kv_heads, rep, d, block, blocks, window, dtype):
    """A paged cache with scattered blocks, B sequences of ragged lengths, and what torch's
    `PagedAttention` computes for their new tokens."""
    from loraserve.engine.core.attention import KVCache, PagedAttention
    cache = KVCache(1, blocks, block, kv_heads, d, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    perm = torch.randperm(blocks, generator=gen).tolist()
    ends = [int(torch.randint(1, 2 * block + 1, (1,), generator=gen)) for _ in range(b)]
    tables, used = [], 0
    for e in ends:
        need = -(-e // block)
        tables.append(perm[used:used + need])
        used += need
    q = torch.randn(b, (kv_heads * rep + 1) * d, generator=gen).to(dtype)[:, d:].unflatten(1, (kv_heads * rep, d))
    k, v = (torch.randn(b, kv_heads, d, generator=gen).to(dtype) for _ in range(2))
    attn = PagedAttention.build(cache, tables, [e - 1 for e in ends], ends, torch.device("cpu"))
    return cache, attn, q, k, v


@settings(max_examples=40, deadline=None, derandomize=True)
@given(b=st.integers(1, 4), kv_heads=st.integers(1, 3), rep=st.integers(1, 3), d=st.sampled_from([2, 8, 24, 64, 128]),
       window=st.sampled_from([None, 1, 3, 7]), dtype=DTYPES, threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_decode_attention_equals_the_paged_sdpa_path(b, kv_heads, rep, d, window, dtype, threads, seed):
    """The fused op (through `PagedAttention`) against the same step through torch's SDPA path,
    cache writes included: every sequence attends to its own slots only, within its window."""
    gen = torch.Generator().manual_seed(seed)
    torch.set_num_threads(threads)
    cache, attn, q, k, v = _attention_case(gen, b, kv_heads, rep, d, 4, 8, window, dtype)
    twin, twin_attn = _clone(cache, attn)
    with torch.inference_mode():
        got = attn(0, q, k, v, window=window)
        cpu_fused.set_enabled(False)
        try:
            want = twin_attn(0, q, k, v, window=window)
        finally:
            cpu_fused.set_enabled(True)
    torch.testing.assert_close(cache.k, twin.k, rtol=0, atol=0)
    torch.testing.assert_close(cache.v, twin.v, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **TOL[dtype])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(b=st.integers(1, 4), kv_heads=st.integers(1, 3), rep=st.integers(1, 3), d=st.sampled_from([2, 8, 24, 64]),
       window=st.sampled_from([None, 1, 3, 7]), normed=st.booleans(), pad=st.integers(0, 3), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_qkv_attention_equals_slices_rope_and_the_paged_sdpa_path(b, kv_heads, rep, d, window, normed, pad, dtype,
                                                                   seed):
    """`PagedAttention.fused_qkv` from a fused q/k/v output (rows padded: a view of a wider
    tensor) against what the model does without it: slice q, k, v, norm and rotate q and k
    (`rms_norm`, `apply_rotary`), then the torch SDPA path; the cache written alike, qkv unchanged."""
    gen = torch.Generator().manual_seed(seed)
    cache, attn, _, _, _ = _attention_case(gen, b, kv_heads, rep, d, 4, 8, window, dtype)
    heads = kv_heads * rep
    wide = torch.randn(b, (heads + 2 * kv_heads) * d + pad, generator=gen).to(dtype)
    qkv = wide[:, pad:]
    before = qkv.clone()
    ang = torch.randn(b, 1, d // 2 if d > 1 else 1, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(heads + kv_heads, d, generator=gen)).to(dtype) if normed else None
    twin, twin_attn = _clone(cache, attn)
    with torch.inference_mode():
        got = attn.fused_qkv(0, qkv, heads, kv_heads, (cos, sin), norm_w, 1e-6, window)
        cpu_fused.set_enabled(False)
        try:
            qk = qkv[:, :(heads + kv_heads) * d].reshape(b, heads + kv_heads, d)
            if normed:
                qk = rms_norm(qk, norm_w, 1e-6)
            qk = apply_rotary(qk, cos, sin)
            v = qkv[:, (heads + kv_heads) * d:].reshape(b, kv_heads, d)
            want = twin_attn(0, qk[:, :heads], qk[:, heads:], v, window=window).reshape(b, heads * d)
        finally:
            cpu_fused.set_enabled(True)
    assert got is not None and got.shape == (b, heads * d)
    torch.testing.assert_close(qkv, before, rtol=0, atol=0)
    torch.testing.assert_close(cache.k, twin.k, **TOL[dtype])
    torch.testing.assert_close(cache.v, twin.v, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_qkv_attention_declines_where_the_fused_decode_op_would():
    """Not a decode step (or autograd on): None, and the model takes its sliced path."""
    gen = torch.Generator().manual_seed(5)
    cache, attn, _, _, _ = _attention_case(gen, 2, 1, 2, 8, 4, 8, None, torch.float32)
    qkv, rope = torch.randn(2, 4 * 8), (torch.ones(2, 1, 8), torch.zeros(2, 1, 8))
    with torch.inference_mode():
        assert attn.fused_qkv(0, qkv, 2, 1, rope, None, 0.0, None) is not None
        prefill = copy_with(attn, single_query=False)
        assert prefill.fused_qkv(0, qkv, 2, 1, rope, None, 0.0, None) is None
        assert attn.fused_qkv(0, qkv.double(), 2, 1, rope, None, 0.0, None) is None  # not the cache's dtype
    with torch.enable_grad():
        assert attn.fused_qkv(0, qkv, 2, 1, rope, None, 0.0, None) is None


def copy_with(obj, **fields):
    import copy
    twin = copy.copy(obj)
    for k, v in fields.items():
        setattr(twin, k, v)
    return twin


@settings(max_examples=30, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), n=st.integers(1, 100), pad=st.integers(0, 3), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_silu_mul_halves_equals_silu_mul_of_the_two_halves(t, n, pad, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    wide = (4 * torch.randn(t, 2 * n + pad, generator=gen)).to(dtype)
    both = wide[:, pad:]
    with torch.inference_mode():
        got = cpu_fused.silu_mul_halves(both)
        torch.testing.assert_close(got, cpu_fused.silu_mul(both[:, :n], both[:, n:]), rtol=0, atol=0)
        torch.testing.assert_close(got, F.silu(both[:, :n]) * both[:, n:], **TOL[dtype])


def _clone(cache, attn):
    import copy
    twin = copy.copy(cache)
    twin.k, twin.v = cache.k.clone(), cache.v.clone()
    twin.k_layers, twin.v_layers = twin.k.unbind(0), twin.v.unbind(0)
    twin_attn = copy.copy(attn)
    twin_attn.cache, twin_attn.window_masks = twin, {}
    return twin, twin_attn


def test_decode_attention_keeps_a_poisoned_sequence_to_itself():
    """A sequence whose K/V hold Inf (an adapter with huge factors) gets NaN; its batch
    neighbour, reading only its own slots, does not."""
    gen = torch.Generator().manual_seed(3)
    cache, attn, q, k, v = _attention_case(gen, 2, 2, 2, 8, 4, 8, None, torch.float32)
    k[0] = float("inf")
    with torch.inference_mode():
        out = attn(0, q, k, v)
    assert not torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("bad", ["slot", "length", "index"])
def test_decode_attention_refuses_indices_outside_the_cache(bad):
    gen = torch.Generator().manual_seed(5)
    cache, attn, q, k, v = _attention_case(gen, 1, 1, 1, 8, 4, 4, None, torch.float32)
    kc, vc = cache.k_layers[0], cache.v_layers[0]
    slots, kv_index, lens = attn.slot_mapping.clone(), attn.kv_index.clone(), attn.lens.clone()
    {"slot": slots, "length": lens, "index": kv_index}[bad][0] = 10**6
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_fused.decode_attention(q, k, v, kc, vc, slots, kv_index, lens, 0, 1.0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(1, 8), inp=st.integers(1, 80), out=st.integers(1, 80), rank=st.integers(1, 20),
       lo=st.integers(0, 7), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_lora_addmm_equals_the_two_products(n, inp, out, rank, lo, dtype, seed):
    """y += (x @ a.T) @ b on a column slice of a wider output (a fused projection's), in float32
    and rounded once into y: equal to the float64 products to rounding."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, out + lo + 3, generator=gen).to(dtype)
    y = wide[:, lo:lo + out]
    x = torch.randn(n, inp + 2, generator=gen).to(dtype)[:, 1:inp + 1]
    a, b = torch.randn(rank, inp, generator=gen).to(dtype), torch.randn(rank, out, generator=gen).to(dtype)
    want = (y.double() + (x.double() @ a.double().T) @ b.double())
    before = wide.clone()
    with torch.inference_mode():
        cpu_fused.lora_addmm_(y, x, a, b)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    torch.testing.assert_close(y.double(), want, **tol)
    outside = torch.ones_like(wide, dtype=torch.bool)
    outside[:, lo:lo + out] = False
    assert torch.equal(wide[outside], before[outside])  # the other columns untouched


_SPECIAL = st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0, -3.0, 1e38, -1e38])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(0, 5), vocab=st.integers(0, 70), pad=st.integers(0, 3),
       specials=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 69), _SPECIAL), max_size=8),
       ties=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_screen_logits_flags_exactly_the_rows_holding_nan_or_inf_and_picks_torchs_argmax(
        rows, vocab, pad, specials, ties, threads, seed):
    """A row is finite iff torch.isfinite holds for all of it (a row of finite values whose sum
    overflows is finite); a finite row's pick is torch.argmax's (first largest; -0.0 == 0.0), a
    non-finite row's -1. Rows of a wider tensor (a stride past the width), every tail length."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, vocab + pad, generator=gen)
    if ties:
        wide = wide.round()  # many equal values: the first largest must win
    for r, i, value in specials:
        if r < rows and i < vocab:
            wide[r, i] = value
    logits = wide[:, :vocab]
    torch.set_num_threads(threads)
    try:
        picked = cpu_fused.screen_logits(logits)
    finally:
        torch.set_num_threads(2)
    want = torch.isfinite(logits).all(dim=-1) if vocab else torch.ones(rows, dtype=torch.bool)
    assert picked.shape == (rows,) and picked.dtype == torch.int64
    for r in range(rows):
        expect = (int(logits[r].argmax()) if vocab else 0) if want[r] else -1
        assert int(picked[r]) == expect


def test_screen_logits_refuses_what_it_cannot_read():
    assert cpu_fused.screens(torch.zeros(2, 5)) and not cpu_fused.screens(torch.zeros(2, 5, dtype=torch.bfloat16))
    assert not cpu_fused.screens(torch.zeros(5)) and not cpu_fused.screens(torch.zeros(5, 2).T)
    for bad in (torch.zeros(2, 5, dtype=torch.float64), torch.zeros(5), torch.zeros(5, 3).T):
        with pytest.raises(RuntimeError, match="screen_logits"):
            cpu_fused.screen_logits(bad)
