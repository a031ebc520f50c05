"""SGMV shrink: v[t, :r(a)] = x[t] @ A[a]^T, A gathered row by row through the row table.

Grid (see `LaunchConfig`): (segment x token block, rank block, K split). A program owns BLOCK_T
tokens of one segment and BLOCK_R rank rows of its slot; programs past the segment's end or the
slot's rank exit at once, so work is proportional to each slot's own rank (rounded up to
BLOCK_R), never to R_max. With SPLIT_K > 1 the H_in reduction is shared by SPLIT_K programs whose
partial sums meet in v with float32 atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shrink
from ._triton import runnable
from .launch import LaunchConfig
from .meta import LoRAMeta


@triton.jit
def _shrink_kernel(x_ptr, v_ptr, a_ptr, rt_ptr, rk_ptr,
                   token_ids_ptr, seg_start_ptr, seg_slot_ptr, seg_expert_ptr,
                   h_in, stride_xt, stride_ap, stride_ae, stride_vt, stride_rt, num_t_blocks,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // num_t_blocks
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    k_split = tl.program_id(2)
    t0 = tl.load(seg_start_ptr + seg) + (pid % num_t_blocks) * BLOCK_T
    t_end = tl.load(seg_start_ptr + seg + 1)
    rank = tl.load(rk_ptr + slot)
    r0 = tl.program_id(1) * BLOCK_R
    if t0 >= t_end or r0 >= rank:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < t_end
    tok = tl.load(token_ids_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = tl.load(rt_ptr + slot * stride_rt + offs_r, mask=r_mask, other=0).to(tl.int64)
    expert = tl.load(seg_expert_ptr + seg).to(tl.int64)
    x_base = x_ptr + tok[:, None] * stride_xt  # [BLOCK_T, 1]
    a_base = a_ptr + rows[:, None] * stride_ap + expert * stride_ae  # [BLOCK_R, 1]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, h_in, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < h_in
        xt = tl.load(x_base + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, tl.trans(at), input_precision=PRECISION)  # [BLOCK_T, BLOCK_R]
    v_ptrs = v_ptr + tok[:, None] * stride_vt + offs_r[None, :]
    out_mask = t_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc.to(v_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=out_mask)


def shrink_triton(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
                  ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for LoRA tokens; every other entry of v is set to 0.

    v [T, R_max] float32 (or x's dtype), unit column stride, written in place (zeroed first);
    x [T, H_in] float32 / bfloat16 / float16, unit column stride, read;
    A_rows [P, H_in] or MoE [P, E, H_in], contiguous, x's dtype, read;
    row_table [A, R_max] int32 and ranks [A] int32, contiguous, read; meta built for these T
    tokens. One launch (plus zeroing v), no host sync.
    """
    check_shrink(v, x, A_rows, row_table, ranks, meta)
    v.zero_()
    t, h_in = x.shape
    if t == 0:
        return
    cfg = LaunchConfig.pick("shrink", num_tokens=t, hidden=h_in, r_max=row_table.shape[1],
                            max_segments=meta.max_segments, dtype=x.dtype, device=x.device,
                            out_dtype=v.dtype)
    stride_ae = A_rows.stride(1) if A_rows.dim() == 3 else 0
    runnable(_shrink_kernel, x.device)[cfg.grid](
        x, v, A_rows, row_table, ranks,
        meta.token_ids, meta.seg_start, meta.seg_slot, meta.seg_expert,
        h_in, x.stride(0), A_rows.stride(0), stride_ae, v.stride(0), row_table.stride(0),
        cfg.num_t_blocks, num_warps=cfg.num_warps, **cfg.constexprs())
