"""SGMV expand: y[t] += v[t, :r(a)] @ B[a]^T, B gathered row by row (B_rows holds B transposed).

Grid: (segment x token block, H_out block, target slice). A program owns BLOCK_T tokens of one
segment and BLOCK_N output columns of one target, and loops over its slot's rank in BLOCK_R
steps (work ~ r(a), not R_max). Each (token, column) has exactly one owner, so y is updated with
a plain read-modify-write. Up to MAX_SLICES targets (q/k/v outputs) go in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_expand
from ._triton import block_n, block_t, dot_config, runnable
from .meta import LoRAMeta

BLOCK_R = 16
MAX_SLICES = 3


@triton.jit
def _expand_kernel(v_ptr, y0_ptr, y1_ptr, y2_ptr, b0_ptr, b1_ptr, b2_ptr,
                   rt0_ptr, rt1_ptr, rt2_ptr, rk0_ptr, rk1_ptr, rk2_ptr,
                   token_ids_ptr, seg_start_ptr, seg_slot_ptr, seg_expert_ptr,
                   h_out0, h_out1, h_out2, stride_y0, stride_y1, stride_y2,
                   stride_rt0, stride_rt1, stride_rt2,
                   stride_bp0, stride_bp1, stride_bp2, stride_be0, stride_be1, stride_be2,
                   stride_vs, stride_vt, num_t_blocks,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // num_t_blocks
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    target = tl.program_id(2)
    if target == 0:
        y_ptr, b_ptr, rt_ptr, rk_ptr = y0_ptr, b0_ptr, rt0_ptr, rk0_ptr
    elif target == 1:
        y_ptr, b_ptr, rt_ptr, rk_ptr = y1_ptr, b1_ptr, rt1_ptr, rk1_ptr
    else:
        y_ptr, b_ptr, rt_ptr, rk_ptr = y2_ptr, b2_ptr, rt2_ptr, rk2_ptr
    h_out = tl.where(target == 0, h_out0, tl.where(target == 1, h_out1, h_out2))
    stride_yt = tl.where(target == 0, stride_y0, tl.where(target == 1, stride_y1, stride_y2))
    stride_rt = tl.where(target == 0, stride_rt0, tl.where(target == 1, stride_rt1, stride_rt2))
    stride_bp = tl.where(target == 0, stride_bp0, tl.where(target == 1, stride_bp1, stride_bp2))
    stride_be = tl.where(target == 0, stride_be0, tl.where(target == 1, stride_be1, stride_be2))
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
    v_base = v_ptr + target.to(tl.int64) * stride_vs + tok[:, None] * stride_vt  # [BLOCK_T, 1]
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
    """y[t] += v[t, :r(a)] @ B[a]^T for LoRA tokens, in place; base-only tokens are untouched.

    y [T, H_out] (unit column stride; may be a column slice of a fused output); v [T, R_max]
    float32 or y's dtype; B_rows [P, H_out] or [P, E, H_out] contiguous, y's dtype;
    row_table [A, R_max] int32; ranks [A] int32. One launch, no host sync.
    """
    expand_stacked_triton([y], v.unsqueeze(0), [B_rows], [row_table], [ranks], meta)


def expand_stacked_triton(ys: list[torch.Tensor], v: torch.Tensor, B_list: list[torch.Tensor],
                          row_tables: list[torch.Tensor], ranks_list: list[torch.Tensor],
                          meta: LoRAMeta) -> None:
    """ys[i][t] += v[i, t, :r_i(a)] @ B_i[a]^T for up to MAX_SLICES targets in one launch.

    v [n, T, R] with unit last stride; ys[i] [T, H_out_i] (widths may differ: q vs k/v);
    B_list[i] [P_i, H_out_i] (or [P_i, E, H_out_i]); row_tables[i] [A, R_max_i]; ranks_list[i].
    """
    n = len(ys)
    if not 1 <= n <= MAX_SLICES or v.dim() != 3 or v.shape[0] != n or v.stride(2) != 1:
        raise ValueError(f"need 1..{MAX_SLICES} targets and an [n, T, R] v with unit last "
                         f"stride, got {n} targets, v {tuple(v.shape)}")
    for y, B_rows, row_table, ranks, vi in zip(ys, B_list, row_tables, ranks_list, v):
        check_expand(y, vi[:, : row_table.shape[1]], B_rows, row_table, ranks, meta)
    t = ys[0].shape[0]
    if t == 0:
        return
    bt = block_t(t, meta.max_segments)
    num_t_blocks = triton.cdiv(t, bt)
    pad = lambda seq: list(seq) + [seq[0]] * (MAX_SLICES - n)  # noqa: E731 - unused slots
    h_max = max(y.shape[1] for y in ys)
    bn = block_n(h_max)
    # Live segments come first and number at most T: later entries need no programs.
    grid = (min(meta.max_segments, t) * num_t_blocks, triton.cdiv(h_max, bn), n)
    runnable(_expand_kernel, ys[0].device)[grid](
        v, *pad(ys), *pad(B_list), *pad(row_tables), *pad(ranks_list),
        meta.token_ids, meta.seg_start, meta.seg_slot, meta.seg_expert,
        *pad([y.shape[1] for y in ys]), *pad([y.stride(0) for y in ys]),
        *pad([rt.stride(0) for rt in row_tables]), *pad([b.stride(0) for b in B_list]),
        *pad([b.stride(1) if b.dim() == 3 else 0 for b in B_list]),
        v.stride(0), v.stride(1), num_t_blocks,
        BLOCK_T=bt, BLOCK_R=BLOCK_R, BLOCK_N=bn, **dot_config(ys[0].dtype, ys[0].device))
