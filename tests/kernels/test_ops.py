"""shrink / expand / add_lora, both backends, against the per-token float32 reference."""

from __future__ import annotations

import pytest
import torch

import loraserve.kernels.torch_backend as torch_backend
from loraserve.kernels import add_lora, expand, shrink
from loraserve.kernels.reference import add_lora_ref, expand_ref, moe_lora_ref, shrink_ref

PATTERNS = ["distinct", "uniform", "zipf", "identical", "skewed"]
MIXED_RANKS = [1, 64, 4, 0, 16, 7, 33, 2]


def _expected(case) -> torch.Tensor:
    y = case.y.clone()
    add_lora_ref(y, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks, case.slots,
                 case.experts)
    return y


def _run_add_lora(case, backend: str) -> torch.Tensor:
    y = case.y.clone()
    buffer = torch.full((y.shape[0], case.row_table.shape[1]), float("nan"), device=y.device)
    add_lora(y, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks, case.meta,
             backend=backend, buffer=buffer)
    return y


@pytest.mark.parametrize("pattern", PATTERNS)
def test_add_lora_popularity(pattern, device, backend, make_case, draw_slots, assert_rel):
    gen = torch.Generator().manual_seed(len(pattern))
    slots = draw_slots(pattern, 24, 24, gen)
    slots[::5] = -1  # base-only tokens in the mix
    ranks = [4 + (a % 3) * 6 for a in range(24)]
    case = make_case(device=device, ranks=ranks, slots=slots, h_in=64, h_out=48)
    assert_rel(_run_add_lora(case, backend), _expected(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_lora_half_precision(dtype, device, backend, make_case, assert_rel):
    slots = torch.tensor([0, 1, -1, 2, 1, 0, 2, 2, -1, 1], dtype=torch.int32)
    case = make_case(device=device, dtype=dtype, ranks=[8, 16, 3], slots=slots, h_in=40, h_out=72)
    assert_rel(_run_add_lora(case, backend), _expected(case), dtype)
    # The rank-space buffer may also be in the activation dtype.
    v = torch.full((10, 16), float("nan"), dtype=dtype, device=device)
    shrink(v, case.x, case.A_rows, case.row_table, case.ranks, case.meta, backend=backend)
    y = case.y.clone()
    expand(y, v, case.B_rows, case.row_table, case.ranks, case.meta, backend=backend)
    assert_rel(y, _expected(case), dtype)


def test_odd_sizes_and_mixed_ranks(device, backend, make_case, assert_rel):
    gen = torch.Generator().manual_seed(7)
    slots = torch.randint(-1, len(MIXED_RANKS), (133,), generator=gen).int()
    case = make_case(device=device, ranks=MIXED_RANKS, slots=slots, h_in=97, h_out=83, seed=3)
    assert_rel(_run_add_lora(case, backend), _expected(case), torch.float32)


def test_wide_input_splits_k(device, backend, make_case, assert_rel):
    # H_in = 257 spans 5 K blocks: the Triton shrink splits the reduction (float32 atomics).
    slots = torch.tensor([0, 1, 1, -1, 0, 1, 2, 0], dtype=torch.int32)
    case = make_case(device=device, ranks=[3, 16, 20], slots=slots, h_in=257, h_out=9)
    assert_rel(_run_add_lora(case, backend), _expected(case), torch.float32)


def test_model_sized_tiles(device, backend, make_case, assert_rel):
    # H_in 2048 / H_out 1024 select the wide tiles (BLOCK_K 128 with 8 K splits, BLOCK_N 128).
    slots = torch.tensor([1, 0, -1, 1, 1], dtype=torch.int32)
    case = make_case(device=device, ranks=[16, 5], slots=slots, h_in=2048, h_out=1024)
    assert_rel(_run_add_lora(case, backend), _expected(case), torch.float32)


def _check_shrink_expand(case, backend: str, assert_rel, dtype=torch.float32) -> None:
    """shrink into a NaN-filled v and expand from it, each against its reference."""
    v = torch.full((case.x.shape[0], case.row_table.shape[1]), float("nan"), device=case.x.device)
    shrink(v, case.x, case.A_rows, case.row_table, case.ranks, case.meta, backend=backend)
    want_v = torch.zeros(v.shape)
    shrink_ref(want_v, case.x.cpu(), case.A_rows.cpu(), case.row_table.cpu(), case.ranks.cpu(),
               case.slots.cpu(), None if case.experts is None else case.experts.cpu())
    assert_rel(v, want_v, dtype)
    y, want_y = case.y.clone(), case.y.clone()
    expand(y, v, case.B_rows, case.row_table, case.ranks, case.meta, backend=backend)
    expand_ref(want_y, v, case.B_rows, case.row_table, case.ranks, case.slots, case.experts)
    assert_rel(y, want_y, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [128, 256])
def test_large_ranks(rank, dtype, device, backend, make_case, assert_rel):
    # R_max 128 / 256: 8 / 16 rank blocks in the shrink grid and as many BLOCK_R steps in the
    # expand loop; a rank-5 slot and one just under R_max ride along in the same table.
    slots = torch.tensor([0, 2, -1, 0, 1], dtype=torch.int32)
    case = make_case(device=device, dtype=dtype, ranks=[rank, 5, rank - 9], slots=slots,
                     h_in=40, h_out=24, seed=rank + 1)
    assert_rel(_run_add_lora(case, backend), _expected(case), dtype)
    if dtype == torch.float32:
        _check_shrink_expand(case, backend, assert_rel)


@pytest.mark.parametrize(("dtype", "rank"),
                         [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 128),
                          (torch.float32, 256)], ids=["fp32-r16", "bf16-r16", "fp32-r128",
                                                      "fp32-r256"])
def test_hidden_4097(dtype, rank, device, backend, make_case, assert_rel):
    # H 4097 = 32 * 128 + 1: the shrink reduction (BLOCK_K 128, 16 K splits) and the expand
    # output tiles (BLOCK_N 128) each end in a one-element masked block.
    slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    case = make_case(device=device, dtype=dtype, ranks=[rank, 3], slots=slots, h_in=4097,
                     h_out=4097, seed=4097 + rank)
    assert_rel(_run_add_lora(case, backend), _expected(case), dtype)
    if dtype == torch.float32 and rank == 16:  # the large ranks alone: test_large_ranks
        _check_shrink_expand(case, backend, assert_rel)


def test_shrink_writes_every_entry(device, backend, make_case, assert_rel):
    slots = torch.tensor([3, -1, 0, 3, 1, 2, 2, -1, 0], dtype=torch.int32)
    case = make_case(device=device, ranks=[5, 0, 17, 2], slots=slots, h_in=50, h_out=8, r_max=20)
    v = torch.full((9, 20), float("nan"), device=device)
    shrink(v, case.x, case.A_rows, case.row_table, case.ranks, case.meta, backend=backend)
    want = torch.zeros(9, 20)  # contract: entries past a token's rank (and base tokens) are 0
    shrink_ref(want, case.x.cpu(), case.A_rows.cpu(), case.row_table.cpu(), case.ranks.cpu(),
               case.slots.cpu())
    assert_rel(v, want, torch.float32)
    assert (v.cpu()[want == 0] == 0).all()


def test_expand_adds_in_place_to_a_column_slice(device, backend, make_case, assert_rel):
    slots = torch.tensor([1, 1, -1, 0, 2, 0, 1], dtype=torch.int32)
    case = make_case(device=device, ranks=[3, 12, 1], slots=slots, h_in=8, h_out=40)
    v = torch.randn(7, 12, device=device)
    fused = torch.randn(7, 100, device=device)
    want = fused.clone()
    expand_ref(want[:, 30:70], v, case.B_rows, case.row_table, case.ranks, case.slots)
    expand(fused[:, 30:70], v, case.B_rows, case.row_table, case.ranks, case.meta, backend=backend)
    assert_rel(fused, want, torch.float32)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_pairs(top_k, device, backend, make_case, assert_rel):
    gen = torch.Generator().manual_seed(top_k)
    num_tokens, num_experts = 11, 4
    token_slot = torch.randint(-1, 3, (num_tokens,), generator=gen).int()
    routed = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                          for _ in range(num_tokens)]).int()
    pair_slots = token_slot.repeat_interleave(top_k)  # [T*k]
    case = make_case(device=device, ranks=[4, 0, 9], slots=pair_slots, h_in=36, h_out=20,
                     num_experts=num_experts, experts=routed.reshape(-1))
    want = case.y.clone()
    moe_lora_ref(want, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks, case.slots,
                 case.experts)
    assert_rel(_run_add_lora(case, backend), want, torch.float32)


@pytest.mark.parametrize("slots", [[2], [-1], [-1, -1, -1]])
def test_single_token_and_no_lora(slots, device, backend, make_case, assert_rel):
    case = make_case(device=device, ranks=[3, 5, 8], slots=torch.tensor(slots, dtype=torch.int32),
                     h_in=16, h_out=24)
    assert_rel(_run_add_lora(case, backend), _expected(case), torch.float32)


def test_empty_segments_and_spare_capacity(device, backend, make_case, assert_rel):
    # Slot 1 has rank 0 (a live segment with no work), many unused segment entries.
    slots = torch.tensor([1, 0, 1, 1, 0, -1], dtype=torch.int32)
    case = make_case(device=device, ranks=[6, 0, 2, 9], slots=slots, h_in=24, h_out=16,
                     max_segments=6)
    assert_rel(_run_add_lora(case, backend), _expected(case), torch.float32)


@pytest.mark.parametrize(("heavy_min", "gather_max"),
                         [(0, 1 << 26), (1000, 1 << 26), (1 << 40, 1 << 26), (1 << 40, 0)])
def test_torch_backend_strategies(heavy_min, gather_max, monkeypatch, make_case, draw_slots,
                                  assert_rel):
    # heavy_min 0: every segment runs its own GEMM; 1000: a mix; 2**40: all gathered, unless
    # the gather cap (gather_max 0) sends everything back to per-segment GEMMs.
    monkeypatch.setattr(torch_backend, "HEAVY_MIN_EXTRA_ELEMENTS", heavy_min)
    monkeypatch.setattr(torch_backend, "GATHER_MAX_ELEMENTS", gather_max)
    gen = torch.Generator().manual_seed(11)
    for pattern in PATTERNS:
        slots = draw_slots(pattern, 40, 8 if pattern != "distinct" else 40, gen)
        ranks = [(a * 5) % 17 for a in range(40 if pattern == "distinct" else 8)]
        case = make_case(device="cpu", ranks=ranks, slots=slots, h_in=33, h_out=21, seed=5)
        assert_rel(_run_add_lora(case, "torch"), _expected(case), torch.float32)
        v = torch.full((40, case.row_table.shape[1]), float("nan"))
        shrink(v, case.x, case.A_rows, case.row_table, case.ranks, case.meta, backend="torch")
        y = case.y.clone()
        expand(y, v, case.B_rows, case.row_table, case.ranks, case.meta, backend="torch")
        assert_rel(y, _expected(case), torch.float32)
