"""Public LoRA ops: one entry point per op, dispatching to the Triton or torch backend."""

from __future__ import annotations

import torch

from .backend import resolve_backend
from .expand import MAX_SLICES, expand_stacked_triton, expand_triton
from .meta import LoRAMeta
from .shrink import shrink_stacked_triton, shrink_triton
from .torch_backend import add_lora_torch, expand_torch, shrink_torch


def shrink(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
           ranks: torch.Tensor, meta: LoRAMeta, *, backend: str = "auto") -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for each token t with slot a >= 0; every other v entry := 0.

    v [T, R_max] float32 (recommended; x's dtype also accepted), written in place.
    x [T, H_in]; A_rows [P, H_in] (MoE: [P, E, H_in]) in x's dtype; row_table [A, R_max] int32;
    ranks [A] int32 (0 = slot has no LoRA on this target); meta from `LoRAMeta.build`.
    """
    if resolve_backend(backend, x.device) == "triton":
        shrink_triton(v, x, A_rows, row_table, ranks, meta)
    else:
        shrink_torch(v, x, A_rows, row_table, ranks, meta)


def expand(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
           ranks: torch.Tensor, meta: LoRAMeta, *, backend: str = "auto") -> None:
    """y[t] += v[t, :r(a)] @ B[a]^T for each token t with slot a >= 0 (scale folded into B).

    y [T, H_out], updated in place (unit column stride, any row stride); v [T, R_max] from
    `shrink`; B_rows [P, H_out] (MoE: [P, E, H_out]) in y's dtype, i.e. B transposed.
    """
    if resolve_backend(backend, y.device) == "triton":
        expand_triton(y, v, B_rows, row_table, ranks, meta)
    else:
        expand_torch(y, v, B_rows, row_table, ranks, meta)


def add_lora(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
             row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta, *,
             backend: str = "auto", buffer: torch.Tensor | None = None, plan=None) -> None:
    """y[t] += B[a] @ (A[a] @ x[t]) for each LoRA token (MoE pairs: B[a, e] @ A[a, e]).

    Shapes as in `shrink` / `expand`. buffer: optional [T, R_max] float32 scratch for the
    rank-space intermediate (allocated when None; pass a preallocated one under CUDA graphs).
    plan: torch backend only, from `plan_torch` (built once per step and target kind).
    """
    if resolve_backend(backend, x.device) == "triton":
        if buffer is None:
            buffer = _buffer(x, row_table.shape[1])
        shrink_triton(buffer, x, A_rows, row_table, ranks, meta)
        expand_triton(y, buffer, B_rows, row_table, ranks, meta)
    else:
        add_lora_torch(y, x, A_rows, B_rows, row_table, ranks, meta, buffer, plan)


def add_lora_stacked(ys: list[torch.Tensor], x: torch.Tensor, A_list: list[torch.Tensor],
                     B_list: list[torch.Tensor], row_tables: list[torch.Tensor],
                     ranks_list: list[torch.Tensor], meta: LoRAMeta, *,
                     backend: str = "auto") -> None:
    """ys[i][t] += B_i[a] @ (A_i[a] @ x[t]) for several targets sharing x (q/k/v, gate/up).

    ys[i] [T, H_out_i] (may be column slices of one fused output); A_list[i] [P_i, H_in];
    B_list[i] [P_i, H_out_i]; row_tables[i] [A, R_max_i]; ranks_list[i] [A]. One meta for all.
    Triton: one shrink and one expand launch per group of up to 3 targets.
    """
    n = len(ys)
    if not n or any(len(seq) != n for seq in (A_list, B_list, row_tables, ranks_list)):
        raise ValueError("add_lora_stacked needs equally long, non-empty lists of targets")
    if resolve_backend(backend, x.device) == "torch":
        for y, A, B, row_table, ranks in zip(ys, A_list, B_list, row_tables, ranks_list):
            add_lora_torch(y, x, A, B, row_table, ranks, meta, _buffer(x, row_table.shape[1]))
        return
    for i in range(0, n, MAX_SLICES):
        group = slice(i, i + MAX_SLICES)
        r_max = max(rt.shape[1] for rt in row_tables[group])
        v = torch.empty(len(ys[group]), x.shape[0], r_max, dtype=torch.float32, device=x.device)
        shrink_stacked_triton(v, x, A_list[group], row_tables[group], ranks_list[group], meta)
        expand_stacked_triton(ys[group], v, B_list[group], row_tables[group], ranks_list[group],
                              meta)


def _buffer(x: torch.Tensor, r_max: int) -> torch.Tensor:
    return torch.empty(x.shape[0], r_max, dtype=torch.float32, device=x.device)
