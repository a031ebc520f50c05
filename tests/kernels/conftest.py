"""Kernel test fixtures. The tests run on the CPU always: the torch backend, and without CUDA
the Triton kernels in the interpreter (TRITON_INTERPRET=1, set before the test modules import
`kernels`). With CUDA they run on the GPU as well, both backends, Triton compiled; the CPU's
Triton cases are left out there (the interpreter is off in a process that has CUDA), and its
torch cases stay, so a CUDA machine tests the CPU backend too."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraserve.kernels import LoRAMeta  # noqa: E402

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
BACKENDS = ["triton", "torch"]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class LoRACase:
    """A random batch: activations, row pools with scattered rows, and per-token slots."""

    x: torch.Tensor  # [T, H_in]
    y: torch.Tensor  # [T, H_out], random initial output
    A_rows: torch.Tensor  # [P, H_in] or [P, E, H_in]
    B_rows: torch.Tensor  # [P, H_out] or [P, E, H_out]
    row_table: torch.Tensor  # [A, R_max] int32, out-of-range junk past each rank
    ranks: torch.Tensor  # [A] int32
    slots: torch.Tensor  # [T] int32
    experts: torch.Tensor | None  # [T] int32 (MoE pairs) or None
    meta: LoRAMeta


def _popularity(pattern: str, num_tokens: int, num_slots: int,
                gen: torch.Generator) -> torch.Tensor:
    """[T] int32 slots drawn with the given adapter popularity (Punica's sweep)."""
    if pattern == "distinct":
        return torch.randperm(num_slots, generator=gen)[:num_tokens].int()
    if pattern == "uniform":
        return torch.randint(0, num_slots, (num_tokens,), generator=gen).int()
    if pattern == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1).double() ** 1.3
        return torch.multinomial(weights, num_tokens, replacement=True, generator=gen).int()
    if pattern == "identical":
        return torch.full((num_tokens,), num_slots - 1, dtype=torch.int32)
    if pattern == "skewed":  # one hot slot, the others one token each
        slots = torch.zeros(num_tokens, dtype=torch.int32)
        tail = min(num_slots - 1, num_tokens - 1)
        slots[:tail] = torch.arange(1, tail + 1, dtype=torch.int32)
        return slots[torch.randperm(num_tokens, generator=gen)]
    raise ValueError(pattern)


def _make_case(*, device: str, dtype: torch.dtype = torch.float32, ranks: list[int],
              slots: torch.Tensor, h_in: int, h_out: int, num_experts: int | None = None,
              experts: torch.Tensor | None = None, r_max: int | None = None, seed: int = 0,
              max_segments: int | None = None) -> LoRACase:
    gen = torch.Generator().manual_seed(seed)
    num_slots, t = len(ranks), slots.numel()
    r_max = r_max or max(max(ranks), 1)
    pool_rows = sum(ranks) + 7
    perm = torch.randperm(pool_rows, generator=gen)
    row_table = torch.full((num_slots, r_max), pool_rows + 1000, dtype=torch.int32)
    offset = 0
    for a, r in enumerate(ranks):
        row_table[a, :r] = perm[offset:offset + r].int()
        offset += r
    lead = (pool_rows,) if num_experts is None else (pool_rows, num_experts)
    A_rows = torch.randn(*lead, h_in, generator=gen) / h_in**0.5
    B_rows = torch.randn(*lead, h_out, generator=gen)
    x = torch.randn(t, h_in, generator=gen)
    y = torch.randn(t, h_out, generator=gen)
    if num_experts is not None and experts is None:
        experts = torch.randint(0, num_experts, (t,), generator=gen).int()
    s_max = max_segments or num_slots * (num_experts or 1)
    on = dict(device=device)
    exp = None if experts is None else experts.to(**on)
    meta = LoRAMeta.build(slots.to(**on), max_segments=s_max, token_experts=exp)
    return LoRACase(x.to(dtype=dtype, **on), y.to(dtype=dtype, **on), A_rows.to(dtype=dtype, **on),
                    B_rows.to(dtype=dtype, **on), row_table.to(**on),
                    torch.tensor(ranks, dtype=torch.int32, device=device), slots.to(**on), exp,
                    meta)


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """max |actual - expected| <= tol * max |expected| (tol by dtype); NaN anywhere fails."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert not actual.isnan().any(), "output holds NaN (an element was never written)"
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max() / scale
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]}"


def pytest_collection_modifyitems(config, items):
    """With CUDA, Triton runs compiled on the GPU only: drop the CPU x Triton cases."""
    if not torch.cuda.is_available():
        return
    keep = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not (params.get("device") == "cpu" and params.get("backend") == "triton"):
            keep.append(item)
        else:
            config.hook.pytest_deselected(items=[item])
    items[:] = keep


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def make_case():
    """Factory for random `LoRACase`s (keyword arguments as `_make_case`)."""
    return _make_case


@pytest.fixture
def draw_slots():
    """popularity(pattern, T, A, generator) -> [T] int32 slots."""
    return _popularity


@pytest.fixture
def assert_rel():
    """assert_rel(actual, expected, dtype): relative max-error check by dtype."""
    return _assert_close_rel
