"""The CPU one-row kernels (loraserve.kernels.cpu_gemv) and the `VectorLinear` that calls them.

The library builds where the CPU has AVX-512 (and its bf16 kernel where it has AVX512-BF16) and a
C++ compiler is on PATH; elsewhere `supports` is False and `VectorLinear` keeps torch's kernels.
Either way a one-row product equals a float64 reference: f32 to rounding, bf16 within one ulp of
the correctly rounded result. Generated shapes cover every tail of the 8/16-row and 16/32-lane
blocks, both weight layouts, and thread counts 1 and 2.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from loraserve.kernels import cpu_gemv
from loraserve.model.prepack import VectorLinear, vector_linears


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_kernels_build_where_the_cpu_has_them():
    flags, compiler = _cpu_flags(), shutil.which("c++") or shutil.which("g++")
    assert cpu_gemv.supports(torch.float32) == bool(compiler and "avx512f" in flags)
    assert cpu_gemv.supports(torch.bfloat16) == bool(compiler and {"avx512f", "avx512_bf16"} <= flags)
    assert not cpu_gemv.supports(torch.float16)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def _assert_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = _reference(x, w)
    assert got.shape == ref.shape and got.dtype == w.dtype
    if w.dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * x.shape[1] ** 0.5)
    else:  # one bf16 ulp of the correctly rounded sum
        rounded = ref.to(torch.bfloat16).double()
        ulp = torch.finfo(torch.bfloat16).eps * rounded.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((got.double() - rounded).abs() <= ulp + 1e-30).all(), (got, rounded)


LAYOUTS = [(torch.float32, "row"), (torch.float32, "column"), (torch.bfloat16, "row")]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(out=st.integers(1, 70), inp=st.integers(1, 150), layout=st.sampled_from(LAYOUTS),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_one_row_product_equals_float64_reference(out, inp, layout, threads, seed):
    dtype, order = layout
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(dtype)
    if order == "column":
        w = w.t().contiguous().t()
    x = torch.randn(1, inp, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if cpu_gemv.supports(dtype):
            _assert_matches(cpu_gemv.vec_linear(x, w), x, w)
        linear = nn.Linear(inp, out, bias=False).to(dtype)
        linear.weight = nn.Parameter(w, requires_grad=False)
        linear.__class__ = VectorLinear
        linear.native = cpu_gemv.supports(dtype)
        _assert_matches(linear(x), x, w)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(1, 70), out=st.integers(1, 70), inp=st.integers(1, 150), layout=st.sampled_from(LAYOUTS),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_a_product_of_any_row_count_equals_float64_reference(rows, out, inp, layout, threads, seed):
    """Several rows: a row-major float32 or bfloat16 weight is read once for 2-64 rows (tiles of 8 weight rows
    by 3, 2 or 1 rows of x: every tail), the rest goes to torch's GEMM; all equal the reference."""
    dtype, order = layout
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(dtype)
    if order == "column":
        w = w.t().contiguous().t()
    x = torch.randn(rows, inp, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if cpu_gemv.supports(dtype):
            got = cpu_gemv.vec_linear(x, w)
            if dtype == torch.float32 or rows <= 64:  # bf16: our kernels up to 64 rows
                _assert_matches(got, x, w)
            else:  # torch's bf16 GEMM rounds as it does, not to one ulp
                torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_linears_use_the_kernel_where_it_exists(dtype):
    """`native` follows `supports`; with a bias, several rows, or gradients a call goes to torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24, bias=True), nn.Linear(24, 9, bias=False)).to(dtype)
    want = [model(torch.ones(1, 40, dtype=dtype))]
    vector_linears(model)
    assert all(m.native == cpu_gemv.supports(dtype) for m in model)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(model(torch.ones(1, 40, dtype=dtype)), want[0], rtol=tol, atol=tol)
    x = torch.randn(1, 40, dtype=dtype, requires_grad=True)
    model(x).sum().backward()  # gradients flow: the kernel has none, so F.linear takes the call
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_failed_build_leaves_torch_kernels_in_place(monkeypatch, tmp_path, caplog):
    """No compiler (or a broken one): a warning, `supports` False, and a VectorLinear that
    still computes its product (through torch)."""
    monkeypatch.setattr(cpu_gemv, "_state", {})
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setenv("LORASERVE_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_gemv.__name__):
        assert not cpu_gemv.supports(torch.float32)
    assert "unavailable" in caplog.text
    linear = nn.Linear(16, 8, bias=False)
    want = linear(torch.ones(1, 16))
    vector_linears(nn.Sequential(linear))
    assert type(linear) is VectorLinear and not linear.native
    torch.testing.assert_close(linear(torch.ones(1, 16)), want)


def test_loading_again_keeps_the_kernels(monkeypatch):
    """A second load in one process (the state reset) finds the same kernels, not a warning."""
    want = cpu_gemv.supports(torch.float32), cpu_gemv.supports(torch.bfloat16)
    monkeypatch.setattr(cpu_gemv, "_state", {})
    assert (cpu_gemv.supports(torch.float32), cpu_gemv.supports(torch.bfloat16)) == want


def test_the_environment_turns_the_kernels_off(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_state", {})
    monkeypatch.setenv("LORASERVE_CPU_GEMV", "0")
    assert not cpu_gemv.supports(torch.float32) and not cpu_gemv.supports(torch.bfloat16)


def test_the_op_refuses_what_it_has_no_kernel_for():
    if not cpu_gemv.supports(torch.float32):
        assert not cpu_gemv.supports(torch.bfloat16)  # nothing built: nothing to call
        return
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_gemv.vec_linear(torch.ones(2, 8), torch.ones(4, 9))
    with pytest.raises(RuntimeError, match="no kernel"):
        cpu_gemv.vec_linear(torch.ones(1, 8, dtype=torch.float16), torch.ones(4, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="no kernel"):  # neither row- nor column-major
        cpu_gemv.vec_linear(torch.ones(1, 8), torch.ones(4, 16)[:, ::2])
    torch.testing.assert_close(cpu_gemv.vec_linear(torch.ones(1, 8), torch.ones(4, 8)), F.linear(
        torch.ones(1, 8), torch.ones(4, 8)))
