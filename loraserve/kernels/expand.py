"""SGMV expand: y[t] += v[t, :r(a)] @ B[a]^T, B gathered row by row (B_rows holds B transposed).

Grid (see `LaunchConfig`): (segment x token block, H_out block, 1). A program owns BLOCK_T tokens
of one segment and BLOCK_N output columns, and loops over its slot's rank in BLOCK_R steps (work
~ r(a), not R_max). Each (token, column) has exactly one owner, so y is updated with a plain
read-modify-write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_expand
from ._triton import runnable
from .launch import LaunchConfig
from .meta import LoRAMeta


@triton.jit
def _expand_kernel(v_ptr, y_ptr, b_ptr, rt_ptr, rk_ptr,
                   token_ids_ptr, seg_start_ptr, seg_slot_ptr, seg_expert_ptr,
                   h_out, stride_yt, stride_vt, stride_rt, stride_bp, stride_be, num_t_blocks,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // num_t_blocks
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    t0 = tl.load(seg_start_ptr + seg) + (pid % num_t_blocks) * BLOCK_T
    t_end = tl.load(seg_start_ptr + seg + 1)
    rank = tl.load(rk_ptr + slot)
    n0 = tl.program_id(1) * BLOCK_N
    if t0 >= t_end or rank <= 0 or n0 >= h_out:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < t_end
    tok = tl.load(token_ids_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < h_out
    expert = tl.load(seg_expert_ptr + seg).to(tl.int64)
    b_base = b_ptr + expert * stride_be.to(tl.int64) + offs_n[None, :]  # [1, BLOCK_N]
    v_base = v_ptr + tok[:, None] * stride_vt  # [BLOCK_T, 1]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        rows = tl.load(rt_ptr + slot * stride_rt + offs_r, mask=r_mask, other=0).to(tl.int64)
        vt = tl.load(v_base + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :],
                     other=0.0)  # [BLOCK_T, BLOCK_R]
        bt = tl.load(b_base + rows[:, None] * stride_bp.to(tl.int64),
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if UPCAST:
            bt = bt.to(tl.float32)
        acc += tl.dot(vt.to(bt.dtype), bt, input_precision=PRECISION)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]
    out_mask = t_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def expand_triton(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
                  ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """y[t] += v[t, :r(a)] @ B[a]^T for LoRA tokens; base-only tokens are untouched.

    y [T, H_out] float32 / bfloat16 / float16, unit column stride (may be a column slice of a
    fused output), updated in place; v [T, R_max] float32 or y's dtype, unit column stride, read;
    B_rows [P, H_out] or MoE [P, E, H_out], contiguous, y's dtype, read;
    row_table [A, R_max] int32 and ranks [A] int32, contiguous, read. One launch, no host sync.
    """
    check_expand(y, v, B_rows, row_table, ranks, meta)
    t, h_out = y.shape
    if t == 0:
        return
    cfg = LaunchConfig.pick("expand", num_tokens=t, hidden=h_out, r_max=row_table.shape[1],
                            max_segments=meta.max_segments, dtype=y.dtype, device=y.device)
    stride_be = B_rows.stride(1) if B_rows.dim() == 3 else 0
    runnable(_expand_kernel, y.device)[cfg.grid](
        v, y, B_rows, row_table, ranks,
        meta.token_ids, meta.seg_start, meta.seg_slot, meta.seg_expert,
        h_out, y.stride(0), v.stride(0), row_table.stride(0), B_rows.stride(0), stride_be,
        cfg.num_t_blocks, num_warps=cfg.num_warps, **cfg.constexprs())
