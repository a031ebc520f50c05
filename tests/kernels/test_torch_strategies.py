"""Each CPU strategy of the torch backend (gather, per-segment GEMM, dense, padded) against the
reference, forced one at a time through `plan_torch(strategy=)`, on random row tables and on
the layout the engine produces (batch grouped by adapter, one run of pool rows at one rank),
where dense and padded work on views."""
from __future__ import annotations

import zlib

import pytest
import torch

from loraserve import kernels
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
    if pattern == "grouped" and strategy in ("dense", "padded"):  # the copy-free fast paths
        assert picked.row_range is not None
        assert (picked.tok is None) if strategy == "dense" else (picked.vtok is None and picked.invalid is None)
    kernels.add_lora_torch(y, x, A_rows, B_rows, table, ranks, meta, plan=picked)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
