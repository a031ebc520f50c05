"""Launch configuration of the SGMV kernels: every tile size, split and grid in one object.

`LaunchConfig.pick` is the only place that chooses how a shrink or expand launch is tiled; the
launchers in `shrink.py` / `expand.py` pass its fields to the kernel unchanged. The choice
depends only on host-side sizes (T, H, R_max, S_max), the dtypes and the device type, never on
tensor contents, so a launch shape is fixed for fixed sizes (CUDA-graph friendly) and the pick is
cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

OPS = ("shrink", "expand")
BLOCK_R = 16  # rank rows per tile: tl.dot needs K >= 16; work per slot rounds up to this
NUM_WARPS = 4  # Triton's default; the tiles below were sized for it
MAX_SPLIT_K = 32


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How one SGMV launch is tiled.

    shrink grid: (segment x token block, rank block, K split); expand grid: (segment x token
    block, H_out block, 1). A program owns `block_t` tokens of one segment.
    """

    op: str  # "shrink" or "expand"
    block_t: int  # tokens per program
    block_r: int  # rank rows per tile (shrink: per program; expand: per loop step)
    block_h: int  # shrink: BLOCK_K, the H_in reduction tile; expand: BLOCK_N, the H_out tile
    split_k: int  # shrink: programs sharing one H_in reduction (float32 atomics); expand: 1
    num_warps: int
    upcast: bool  # bf16 tiles upcast to float32 before tl.dot (the interpreter's bf16 dot is wrong)
    precision: str  # tl.dot input_precision: "ieee" (float32, exact) or "tf32" (half types)
    num_t_blocks: int  # token blocks per segment: cdiv(T, block_t)
    grid: tuple[int, int, int]

    @classmethod
    def pick(cls, op: str, *, num_tokens: int, hidden: int, r_max: int, max_segments: int,
             dtype: torch.dtype, device: torch.device | str,
             out_dtype: torch.dtype = torch.float32) -> LaunchConfig:
        """The launch for `op` over T=num_tokens tokens and S_max=max_segments segments.

        hidden: H_in for shrink (the reduction), H_out for expand (the output columns).
        r_max: R_max, the row table's width. dtype: the activations' and pools' dtype.
        out_dtype: shrink's v dtype; K is split (float32 atomics) only when it is float32.
        """
        if op not in OPS:
            raise ValueError(f"unknown SGMV op {op!r}; choose one of {', '.join(OPS)}")
        if min(num_tokens, hidden, r_max) < 0 or max_segments < 1:
            raise ValueError(f"bad launch sizes T={num_tokens} H={hidden} R_max={r_max} "
                             f"S_max={max_segments}")
        return _pick(op, num_tokens, hidden, r_max, max_segments, dtype,
                     torch.device(device).type, out_dtype == torch.float32)

    def constexprs(self) -> dict[str, object]:
        """The kernel's constexpr keyword arguments (without the launch option num_warps)."""
        common = {"BLOCK_T": self.block_t, "BLOCK_R": self.block_r, "UPCAST": self.upcast,
                  "PRECISION": self.precision}
        if self.op == "shrink":
            return {**common, "BLOCK_K": self.block_h, "SPLIT_K": self.split_k}
        return {**common, "BLOCK_N": self.block_h}


@lru_cache(maxsize=4096)
def _pick(op: str, t: int, h: int, r_max: int, s_max: int, dtype: torch.dtype, device_type: str,
          float32_out: bool) -> LaunchConfig:
    bt = _block_t(t, s_max)
    num_t_blocks = triton.cdiv(t, bt)
    # Live segments come first and number at most T: later entries need no programs.
    seg_programs = min(s_max, t) * num_t_blocks
    if op == "shrink":
        bh = 128 if h >= 2048 else 64  # wider reduction tiles for model-sized inputs
        splits = _split_k(h, bh, t) if float32_out else 1
        grid = (seg_programs, triton.cdiv(r_max, BLOCK_R), splits)
    else:
        bh = 128 if h >= 1024 else 64  # wider output tiles for model-sized outputs
        splits = 1
        grid = (seg_programs, triton.cdiv(h, bh), 1)
    # float32 uses exact IEEE products (TF32 would miss the 1e-4 tolerance). The Triton 3.x
    # interpreter computes bfloat16 dots wrongly, so off CUDA bf16 tiles are upcast first.
    upcast = device_type != "cuda" and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return LaunchConfig(op, bt, BLOCK_R, bh, splits, NUM_WARPS, upcast, precision,
                        num_t_blocks, grid)


def _block_t(num_tokens: int, max_segments: int) -> int:
    """Tokens per program: 16 at decode sizes (segments hold a few tokens), 64 for prefill."""
    per_segment = num_tokens / max(max_segments, 1)
    return 16 if num_tokens <= 256 or per_segment <= 16 else 64


def _split_k(h_in: int, block_k: int, num_tokens: int) -> int:
    """K splits for shrink: decode has few programs, so split the H_in reduction across more.
    Each split still walks at least 2 K blocks; prefill (T > 1024) has programs enough."""
    if num_tokens > 1024:
        return 1
    return max(1, min(MAX_SPLIT_K, triton.cdiv(h_in, block_k) // 2))
