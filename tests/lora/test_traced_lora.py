"""`add_lora_traced`, the LoRA pass a compiled CPU decode step runs (engine.core.decode_graphs):
the float32 oracle's result for any mix of slots, ranks and base-only tokens, compiled or not, and
no other adapter's rows leak in: Inf and NaN planted in every row a token must not use (other
slots, rank positions past its slot's rank) leave its output finite and exact."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from loraserve.kernels.reference import add_lora_ref
from loraserve.lora.layers import add_lora_traced

H, O, P, SLOTS, R = 32, 24, 96, 5, 8


def _case(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    A, B = torch.randn(P, H, generator=g), torch.randn(P, O, generator=g)
    table = torch.randperm(P, generator=g)[: SLOTS * R].view(SLOTS, R).int()
    ranks = torch.tensor([8, 3, 0, 5, 1], dtype=torch.int32)
    slots = torch.tensor([1, -1, 3, 3, 0, 2, -1, 4, 1], dtype=torch.int32)
    x, y = torch.randn(len(slots), H, generator=g), torch.randn(len(slots), O, generator=g)
    # poison every row no token may read: slot 2 (rank 0) and positions past each slot's rank
    for s in range(SLOTS):
        dead = table[s, int(ranks[s]):].long()
        A[dead], B[dead] = float("inf"), float("nan")
    used = {int(table[s, i]) for s in range(SLOTS) for i in range(int(ranks[s]))}
    spare = [p for p in range(P) if p not in used]
    A[spare], B[spare] = float("nan"), float("inf")
    want = y.clone()
    clean_A, clean_B = A.nan_to_num(0, 0, 0), B.nan_to_num(0, 0, 0)  # the oracle never reads them
    add_lora_ref(want, x, clean_A, clean_B, table, ranks, slots)
    return [t.to(dtype) if t.is_floating_point() else t for t in (y, x, A, B)] + [table, ranks, slots, want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_lora_equals_the_oracle_and_reads_no_foreign_row(dtype):
    y, x, A, B, table, ranks, slots, want = _case(0, dtype)
    add_lora_traced(y, x, A, B, table, ranks, slots)
    assert y.dtype == dtype and bool(torch.isfinite(y).all())
    tol = 1e-5 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)


def test_compiled_traced_lora_equals_eager():
    y, x, A, B, table, ranks, slots, want = _case(1)
    compiled = torch.compile(add_lora_traced, dynamic=False, fullgraph=True)
    got = y.clone()
    compiled(got, x, A, B, table, ranks, slots)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_traced_lora_property_any_slots_ranks_and_poison(data):
    """Generated variants: any token count, slot per token (base-only included), rank per slot
    (0 included), row table; every row no live position names holds Inf or NaN. The traced pass
    equals the oracle over the clean rows and stays finite."""
    t = data.draw(st.integers(1, 12))
    slots_n, r = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 8))
    ranks = torch.tensor(data.draw(st.lists(st.integers(0, r), min_size=slots_n, max_size=slots_n)),
                         dtype=torch.int32)
    slots = torch.tensor(data.draw(st.lists(st.integers(-1, slots_n - 1), min_size=t, max_size=t)),
                         dtype=torch.int32)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    table = torch.randperm(P, generator=g)[: slots_n * r].view(slots_n, r).int()
    A, B = torch.randn(P, H, generator=g), torch.randn(P, O, generator=g)
    x, y = torch.randn(t, H, generator=g), torch.randn(t, O, generator=g)
    live = {int(table[s, i]) for s in range(slots_n) for i in range(int(ranks[s]))}
    want = y.clone()
    add_lora_ref(want, x, A, B, table, ranks, slots)
    dead = [p for p in range(P) if p not in live]
    A[dead] = float(data.draw(st.sampled_from(["inf", "-inf", "nan"])))
    B[dead] = float(data.draw(st.sampled_from(["inf", "nan"])))
    add_lora_traced(y, x, A, B, table, ranks, slots)
    assert bool(torch.isfinite(y).all())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
