"""LaunchConfig: the one place that tiles a shrink / expand launch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraserve.kernels.launch import BLOCK_R, LaunchConfig


def _pick(op: str, t: int, h: int, r_max: int = 64, s_max: int = 8, dtype=torch.bfloat16,
          device: str = "cuda", **kw) -> LaunchConfig:
    return LaunchConfig.pick(op, num_tokens=t, hidden=h, r_max=r_max, max_segments=s_max,
                             dtype=dtype, device=device, **kw)


def test_decode_shrink_splits_k_and_prefill_does_not():
    decode = _pick("shrink", 8, 4096)
    assert (decode.block_t, decode.block_h, decode.split_k) == (16, 128, 16)
    assert decode.grid == (8, 64 // BLOCK_R, 16)
    prefill = _pick("shrink", 2048, 1024, s_max=4)
    assert (prefill.block_t, prefill.block_h, prefill.split_k) == (64, 64, 1)
    assert prefill.grid == (4 * 32, 4, 1)
    # K is split (float32 atomics) only into a float32 v
    assert _pick("shrink", 8, 4096, out_dtype=torch.bfloat16).split_k == 1


def test_expand_tiles_and_grid():
    wide = _pick("expand", 8, 4097)
    assert (wide.block_t, wide.block_h, wide.split_k) == (16, 128, 1)
    assert wide.grid == (8, 33, 1)
    narrow = _pick("expand", 300, 512, s_max=2)
    assert (narrow.block_t, narrow.block_h) == (64, 64)
    assert narrow.grid == (2 * 5, 8, 1)
    assert set(narrow.constexprs()) == {"BLOCK_T", "BLOCK_R", "BLOCK_N", "UPCAST", "PRECISION"}


@pytest.mark.parametrize("r_max", [16, 128, 256])
def test_rank_blocks_cover_r_max(r_max):
    cfg = _pick("shrink", 4, 64, r_max=r_max)
    assert cfg.grid[1] * cfg.block_r >= r_max > (cfg.grid[1] - 1) * cfg.block_r


def test_dot_precision_by_dtype_and_device():
    assert _pick("shrink", 4, 64, dtype=torch.float32).precision == "ieee"
    assert (_pick("shrink", 4, 64).precision, _pick("shrink", 4, 64).upcast) == ("tf32", False)
    cpu_bf16 = _pick("expand", 4, 64, device="cpu")  # the interpreter's bf16 dot is wrong
    assert (cpu_bf16.precision, cpu_bf16.upcast) == ("ieee", True)


def test_frozen_cached_and_validated():
    cfg = _pick("shrink", 4, 64)
    assert _pick("shrink", 4, 64) is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_t = 32
    with pytest.raises(ValueError, match="unknown SGMV op"):
        _pick("gemm", 4, 64)
    with pytest.raises(ValueError, match="bad launch sizes"):
        _pick("shrink", 4, 64, s_max=0)
