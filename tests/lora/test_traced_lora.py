"""`add_lora_traced`, the LoRA pass a compiled CPU decode step runs (engine.core.decode_graphs):
the float32 oracle's result for any mix of slots, ranks and base-only tokens, compiled or not, and
no other adapter's rows leak in: Inf and NaN planted in every row a token must not use (other
slots, rank positions past its slot's rank) leave its output finite and exact."""
from __future__ import annotations

import pytest
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
