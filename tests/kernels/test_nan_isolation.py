"""The LoRA math never mixes adapters: NaN planted in one adapter's pool rows (behind every
validator's back) never reaches another adapter's tokens or base-only tokens, on every torch
strategy and on the Triton backend (interpreted on CPU, compiled on CUDA).

Each case runs the same batch twice, once with the planted adapter's rows finite and once with
them NaN; every row of a token that does not use that adapter must be bit-identical.
"""
from __future__ import annotations

import pytest
import torch

from loraserve import kernels
from loraserve.kernels import LoRAMeta
from loraserve.kernels.torch_backend import STRATEGIES

BAD_SLOT = 1
PATTERNS = {
    # sorted by slot, base-only last: the engine's layout
    "grouped": [0, 0, 0, 1, 1, 1, 2, 2, 2, -1],
    "grouped-one-each": [0, 1, 2, 3, -1],
    "scattered": [2, 1, -1, 0, 1, 3, 0, 2, -1, 1],
    "prefill-like": [0] * 9 + [1] * 9 + [2] * 9 + [-1] * 3,
}


def _case(pattern: str, rank_mode: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor(PATTERNS[pattern], dtype=torch.int32)
    A, R, H, O = 4, 8, 24, 20
    # mixed: slot 3 has no LoRA on this kind (rank 0), as an adapter that targets other kinds
    ranks = torch.full((A,), R, dtype=torch.int32) if rank_mode == "equal" else \
        torch.tensor([8, 3, 5, 0], dtype=torch.int32)
    if rank_mode == "equal":  # one run of pool rows at one rank: the engine's copy-free layout
        table = (torch.arange(A * R) + 4).view(A, R).int()
    else:  # scattered rows; the planted adapter owns pool row 0 (what padding used to read)
        table = torch.randperm(63, generator=gen)[: A * R].view(A, R).int().contiguous() + 1
        table[BAD_SLOT, 0] = 0
        table[3] = 0  # a slot without LoRA here has a zeroed row table, as the pool leaves it
    A_rows, B_rows = torch.randn(64, H, generator=gen), torch.randn(64, O, generator=gen)
    x, y = torch.randn(len(slots), H, generator=gen), torch.randn(len(slots), O, generator=gen)
    return slots, table, ranks, A_rows, B_rows, x, y


def _poison(rows: torch.Tensor, table: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    bad = rows.clone()
    bad[table[BAD_SLOT, : ranks[BAD_SLOT]].long()] = float("nan")
    return bad


def _run(add, slots, table, ranks, A_rows, B_rows, x, y, device="cpu") -> torch.Tensor:
    slots, table, ranks, A_rows, B_rows, x, y = (
        t.to(device) for t in (slots, table, ranks, A_rows, B_rows, x, y))
    out = y.clone()
    meta = LoRAMeta.build(slots, max_segments=int(ranks.numel()))
    add(out, x, A_rows, B_rows, table, ranks, meta)
    return out.cpu()


def _check(add, pattern: str, rank_mode: str, device: str = "cpu") -> None:
    slots, table, ranks, A_rows, B_rows, x, y = _case(pattern, rank_mode)
    run = lambda a, b: _run(add, slots, table, ranks, a, b, x, y, device)  # noqa: E731
    clean = run(A_rows, B_rows)
    for which in ("A", "B", "both"):
        bad_a = _poison(A_rows, table, ranks) if which in ("A", "both") else A_rows
        bad_b = _poison(B_rows, table, ranks) if which in ("B", "both") else B_rows
        got = run(bad_a, bad_b)
        others = slots != BAD_SLOT
        msg = f"NaN in adapter {BAD_SLOT}'s {which} rows reached other tokens ({pattern}, {rank_mode})"
        if device == "cpu":
            assert torch.equal(got[others], clean[others]), msg
        else:  # compiled kernels may split K and sum in another order: finite and equal to 1e-5
            assert got[others].isfinite().all(), msg
            torch.testing.assert_close(got[others], clean[others], rtol=1e-5, atol=1e-5, msg=msg)
        if (slots == BAD_SLOT).any():
            assert got[~others].isnan().any()  # the planted adapter's own tokens do see it


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("rank_mode", ["equal", "mixed"])
def test_torch_strategies_never_mix_adapters(strategy, pattern, rank_mode) -> None:
    def add(y, x, A_rows, B_rows, table, ranks, meta):
        plan = kernels.plan_torch(meta, table, ranks, A_rows, B_rows, strategy=strategy)
        kernels.add_lora_torch(y, x, A_rows, B_rows, table, ranks, meta, plan=plan)
    _check(add, pattern, rank_mode)


@pytest.mark.parametrize("backend", ["triton"])  # named, so the conftest leaves out CPU Triton under CUDA
@pytest.mark.parametrize("pattern", ["grouped", "scattered"])
def test_triton_never_mixes_adapters(pattern, device, backend) -> None:
    def add(y, x, A_rows, B_rows, table, ranks, meta):
        kernels.add_lora(y, x, A_rows, B_rows, table, ranks, meta, backend=backend)
    _check(add, pattern, "mixed", device)
