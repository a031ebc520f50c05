"""Each CPU strategy of the torch backend (gather, per-segment GEMM, padded) against the
reference, forced one at a time through `plan_torch(strategy=)`, on random row tables and on
the layout the engine produces (batch grouped by adapter, one run of pool rows at one rank),
where padded works on views."""
from __future__ import annotations

import zlib

import pytest
import torch

from loraserve import kernels
import loraserve.kernels.torch_backend as tb
from loraserve.kernels import LoRAMeta
from loraserve.kernels.reference import add_lora_ref
from loraserve.kernels.torch_backend import STRATEGIES


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("pattern", ["one", "few", "skewed", "with-base-tokens", "grouped", "grouped-uneven"])
def test_strategy_matches_reference(strategy, pattern):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{strategy}-{pattern}".encode()))
    T, H, O, P, A, R = 29, 48, 40, 256, 8, 16
    A_rows, B_rows = torch.randn(P, H, generator=gen), torch.randn(P, O, generator=gen)
    table = torch.randperm(P, generator=gen)[: A * R].view(A, R).int().contiguous()
    ranks = torch.randint(1, R + 1, (A,), generator=gen, dtype=torch.int32)
    if pattern.startswith("grouped"):  # the engine's layout: adapter a owns rows 16a..16a+15
        table = (torch.arange(A * R) + 32).view(A, R).int()
        ranks = torch.full((A,), R, dtype=torch.int32)
    slots = {"one": torch.full((T,), 3), "few": torch.arange(T) % 3,
             "skewed": torch.where(torch.arange(T) < 20, 5, torch.arange(T) % A),
             "with-base-tokens": torch.where(torch.arange(T) % 4 == 0, -1, torch.arange(T) % 5),
             # sorted by slot, base-only tokens last, as ModelRunner orders a LoRA batch
             "grouped": torch.tensor([1] * 7 + [2] * 7 + [3] * 7 + [4] * 7 + [-1]),
             "grouped-uneven": torch.tensor([0] * 3 + [1] * 20 + [2] + [-1] * 5)}[pattern]
    slots = slots.int()
    x = torch.randn(T, H, generator=gen)
    y = torch.randn(T, O, generator=gen)
    want = y.clone()
    add_lora_ref(want, x, A_rows, B_rows, table, ranks, slots)
    meta = LoRAMeta.build(slots, max_segments=A)
    picked = kernels.plan_torch(meta, table, ranks, A_rows, B_rows, strategy=strategy)
    assert picked.name == strategy, f"{strategy} was not chosen"
    if pattern.startswith("grouped") and strategy == "segments":  # row ranges, no gather
        assert picked.direct
    if pattern == "grouped" and strategy == "padded":  # the copy-free fast path
        assert picked.row_range is not None
        assert picked.vtok is None and picked.invalid is None
    kernels.add_lora_torch(y, x, A_rows, B_rows, table, ranks, meta, plan=picked)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def _target(gen, P, H, O, table, ranks):
    return torch.randn(P, H, generator=gen), torch.randn(P, O, generator=gen), table, ranks


def test_plan_cache_reuses_shares_and_drops_plans(monkeypatch):
    """One plan per step for kinds with equal row tables, run directly by later calls; a new
    meta object (a new step) plans again; MoE calls interleaved with dense ones keep their own
    scope; a forced strategy reaches every plan. Every call matches the reference."""
    built = []
    plan_torch = tb.plan_torch
    monkeypatch.setattr(tb, "plan_torch", lambda *a, **k: built.append(k) or plan_torch(*a, **k))
    gen = torch.Generator().manual_seed(3)
    T, H, P, A, R, E = 12, 16, 64, 4, 8, 3
    table = torch.arange(A * R, dtype=torch.int32).view(A, R)
    ranks = torch.tensor([8, 4, 8, 2], dtype=torch.int32)
    other_table = table.flip(0).contiguous()  # another kind whose adapters hold other rows
    slots = torch.tensor([0] * 5 + [2] * 4 + [-1] * 3, dtype=torch.int32)
    experts = torch.arange(T, dtype=torch.int32) % E
    cache = tb.PlanCache(strategy="gather")

    def call(meta, key, weights, moe=False):
        A_rows, B_rows, tbl, rk = weights
        x = torch.randn(T, A_rows.shape[-1], generator=gen)
        y = torch.randn(T, B_rows.shape[-1], generator=gen)
        want = y.clone()
        add_lora_ref(want, x, A_rows, B_rows, tbl, rk, slots, experts if moe else None)
        cache.add(key, y, x, A_rows, B_rows, tbl, rk, meta)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)

    q, v = _target(gen, P, H, H, table, ranks), _target(gen, P, H, 8, table.clone(), ranks.clone())
    o = _target(gen, P, H, H, other_table, ranks)
    moe = (torch.randn(P, E, H, generator=gen), torch.randn(P, E, H, generator=gen), table, ranks)
    for step in range(2):
        meta = LoRAMeta.build(slots, max_segments=A)  # a new object each step
        pair_meta = LoRAMeta.build(slots, max_segments=A * E, token_experts=experts)
        for layer in range(2):
            call(meta, "q_proj", q)
            call(pair_meta, ("experts.up_proj", 0), moe, moe=True)
            call(meta, "v_proj", v)  # equal rows: q's plan
            call(meta, "o_proj", o)  # other rows: its own plan
        assert len(built) == 3 * (step + 1), "one plan per distinct rows and scope per step"
    assert all(k == {"strategy": "gather"} for k in built)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 12])
def test_one_adapter_in_reduced_precision_matches_the_float32_oracle(dtype, rows):
    """One adapter's decode rows in bfloat16/float16 on the CPU run in float32 (`_Padded.run`
    widens its rank rows: oneDNN's reduced-precision GEMM costs twice as much at these shapes);
    past `_WIDEN_MAX_ROWS` the GEMMs stay in the dtype. Either way the result is the float32
    oracle's to the dtype's rounding, and it lands in y's dtype."""
    gen = torch.Generator().manual_seed(rows)
    H, O, P, R = 64, 96, 64, 8
    A_rows, B_rows = torch.randn(P, H, generator=gen).to(dtype), torch.randn(P, O, generator=gen).to(dtype)
    table = (torch.arange(R) + 16).view(1, R).int()
    ranks = torch.full((1,), R, dtype=torch.int32)
    slots = torch.zeros(rows, dtype=torch.int32)
    x, y = torch.randn(rows, H, generator=gen).to(dtype), torch.randn(rows, O, generator=gen).to(dtype)
    want = y.float()
    add_lora_ref(want, x.float(), A_rows.float(), B_rows.float(), table, ranks, slots)
    meta = LoRAMeta.build(slots, max_segments=1)
    plan = kernels.plan_torch(meta, table, ranks, A_rows, B_rows, strategy="padded")
    assert plan.row_range is not None and plan.vtok is None   # the one-adapter fast path
    kernels.add_lora_torch(y, x, A_rows, B_rows, table, ranks, meta, plan=plan)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=0.25)
