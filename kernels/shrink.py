"""SGMV shrink: v[t, :r(a)] = x[t] @ A[a]^T, A gathered row by row through the row table.

Grid: (segment x token block, rank block, target slice x K split). A program owns BLOCK_T tokens
of one segment and BLOCK_R rank rows of its slot on one target; programs past the segment's end
or the slot's rank exit at once, so work is proportional to each slot's own rank (rounded up to
BLOCK_R), never to R_max. Up to MAX_SLICES targets sharing x (q/k/v) go in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shrink
from ._triton import block_k, block_t, dot_config, runnable, split_k
from .meta import LoRAMeta

BLOCK_R = 16
MAX_SLICES = 3


@triton.jit
def _shrink_kernel(x_ptr, v_ptr, a0_ptr, a1_ptr, a2_ptr, rt0_ptr, rt1_ptr, rt2_ptr,
                   rk0_ptr, rk1_ptr, rk2_ptr,
                   token_ids_ptr, seg_start_ptr, seg_slot_ptr, seg_expert_ptr,
                   h_in, stride_xt, stride_ap, stride_ae, stride_vs, stride_vt,
                   stride_rt0, stride_rt1, stride_rt2, num_t_blocks,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // num_t_blocks
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    target = tl.program_id(2) // SPLIT_K
    k_split = tl.program_id(2) % SPLIT_K
    if target == 0:
        a_ptr, rt_ptr, rk_ptr = a0_ptr, rt0_ptr, rk0_ptr
    elif target == 1:
        a_ptr, rt_ptr, rk_ptr = a1_ptr, rt1_ptr, rk1_ptr
    else:
        a_ptr, rt_ptr, rk_ptr = a2_ptr, rt2_ptr, rk2_ptr
    stride_rt = tl.where(target == 0, stride_rt0, tl.where(target == 1, stride_rt1, stride_rt2))
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
    v_ptrs = v_ptr + target.to(tl.int64) * stride_vs + tok[:, None] * stride_vt + offs_r[None, :]
    out_mask = t_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc.to(v_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=out_mask)


def shrink_triton(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
                  ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for LoRA tokens; every other entry of v is set to 0.

    v [T, R_max] float32 (or x's dtype), written in place; x [T, H_in] (unit column stride);
    A_rows [P, H_in] or [P, E, H_in] contiguous, x's dtype; row_table [A, R_max] int32;
    ranks [A] int32; meta built for these T tokens. One launch (plus zeroing v), no host sync.
    """
    shrink_stacked_triton(v.unsqueeze(0), x, [A_rows], [row_table], [ranks], meta)


def shrink_stacked_triton(v: torch.Tensor, x: torch.Tensor, A_list: list[torch.Tensor],
                          row_tables: list[torch.Tensor], ranks_list: list[torch.Tensor],
                          meta: LoRAMeta) -> None:
    """v[i, t, :r_i(a)] = x[t] @ A_i[a]^T for up to MAX_SLICES targets in one launch.

    v [n, T, R] with unit last stride (R >= every target's R_max), zeroed first; per target i:
    A_list[i] [P_i, H_in] (or [P_i, E, H_in], all with the same E), row_tables[i] [A, R_max_i],
    ranks_list[i] [A].
    """
    n = len(A_list)
    if not 1 <= n <= MAX_SLICES or v.dim() != 3 or v.shape[0] != n or v.stride(2) != 1:
        raise ValueError(f"need 1..{MAX_SLICES} targets and an [n, T, R] v with unit last "
                         f"stride, got {n} targets, v {tuple(v.shape)}")
    for A_rows, row_table, ranks in zip(A_list, row_tables, ranks_list):
        check_shrink(v[0][:, : row_table.shape[1]], x, A_rows, row_table, ranks, meta)
        if A_rows.stride()[:-1] != A_list[0].stride()[:-1]:
            raise ValueError("stacked A pools must share their layout past the row axis")
    v.zero_()
    t, h_in = x.shape
    if t == 0:
        return
    bt = block_t(t, meta.max_segments)
    bk = block_k(h_in)
    splits = split_k(h_in, bk, t) if v.dtype == torch.float32 else 1
    num_t_blocks = triton.cdiv(t, bt)
    A0 = A_list[0]
    stride_ae = A0.stride(1) if A0.dim() == 3 else 0
    pad = lambda seq: list(seq) + [seq[0]] * (MAX_SLICES - n)  # noqa: E731 - unused slots
    r_max = max(rt.shape[1] for rt in row_tables)
    # Live segments come first and number at most T: later entries need no programs.
    grid = (min(meta.max_segments, t) * num_t_blocks, triton.cdiv(r_max, BLOCK_R), n * splits)
    runnable(_shrink_kernel, x.device)[grid](
        x, v, *pad(A_list), *pad(row_tables), *pad(ranks_list),
        meta.token_ids, meta.seg_start, meta.seg_slot, meta.seg_expert,
        h_in, x.stride(0), A0.stride(0), stride_ae, v.stride(0), v.stride(1),
        *pad([rt.stride(0) for rt in row_tables]), num_t_blocks,
        BLOCK_T=bt, BLOCK_R=BLOCK_R, BLOCK_K=bk, SPLIT_K=splits,
        **dot_config(x.dtype, x.device))
