"""Input checks shared by every launcher: clear errors instead of wrong memory accesses.

What needs a host sync (slot ids in range, ranks <= R_max, row ids < P) is not checked here;
the torch backend checks it on CPU, where it is free (see `torch_backend.py`).
"""

from __future__ import annotations

import torch

from .meta import LoRAMeta

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tables(row_table: torch.Tensor, ranks: torch.Tensor, device: torch.device) -> None:
    """row_table [A, R_max] int32 contiguous, ranks [A] int32 contiguous, both on `device`."""
    if row_table.dim() != 2 or row_table.dtype != torch.int32 or not row_table.is_contiguous():
        raise ValueError(f"row_table must be a contiguous [A, R_max] int32 tensor, got "
                         f"{row_table.dtype} {tuple(row_table.shape)}")
    if (ranks.shape != row_table.shape[:1] or ranks.dtype != torch.int32
            or not ranks.is_contiguous()):
        raise ValueError(f"ranks must be a contiguous [A={row_table.shape[0]}] int32 tensor, got "
                         f"{ranks.dtype} {tuple(ranks.shape)}")
    for name, t in (("row_table", row_table), ("ranks", ranks)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_pool(name: str, pool: torch.Tensor, width: int, meta: LoRAMeta,
               dtype: torch.dtype) -> None:
    """A row pool: [P, width] (dense) or [P, E, width] (MoE, when meta carries experts)."""
    want_dim = 3 if meta.moe else 2
    if pool.dim() != want_dim:
        kind = "MoE [P, E, H]" if meta.moe else "dense [P, H]"
        raise ValueError(f"{name} must be a {kind} pool to match the meta, got {tuple(pool.shape)}")
    if pool.shape[-1] != width:
        raise ValueError(f"{name} rows have width {pool.shape[-1]}, expected {width}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if pool.dtype != dtype:
        raise ValueError(f"{name} is {pool.dtype}, expected {dtype} (like the activations)")
    if pool.device != meta.device:
        raise ValueError(f"{name} is on {pool.device}, meta on {meta.device}")


def check_rows(name: str, t: torch.Tensor, meta: LoRAMeta, width: int | None = None) -> None:
    """A [T, width] activation tensor with unit column stride (any row stride) on meta's device."""
    if t.dim() != 2 or t.shape[0] != meta.num_tokens:
        raise ValueError(f"{name} must be [T={meta.num_tokens}, H], got {tuple(t.shape)}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} has width {t.shape[1]}, expected {width}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs unit stride along its last axis")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.device != meta.device:
        raise ValueError(f"{name} is on {t.device}, meta on {meta.device}")


def check_buffer(v: torch.Tensor, meta: LoRAMeta, r_max: int, x_dtype: torch.dtype) -> None:
    """The [T, R_max] intermediate: float32 (recommended) or the activation dtype."""
    check_rows("v", v, meta, r_max)
    if v.dtype not in (torch.float32, x_dtype):
        raise ValueError(f"v must be float32 or {x_dtype}, got {v.dtype}")


def check_shrink(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """All of shrink's shape / dtype / device / layout preconditions."""
    check_rows("x", x, meta)
    check_pool("A_rows", A_rows, x.shape[1], meta, x.dtype)
    check_tables(row_table, ranks, meta.device)
    check_buffer(v, meta, row_table.shape[1], x.dtype)


def check_expand(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """All of expand's shape / dtype / device / layout preconditions."""
    check_rows("y", y, meta)
    check_pool("B_rows", B_rows, y.shape[1], meta, y.dtype)
    check_tables(row_table, ranks, meta.device)
    check_buffer(v, meta, row_table.shape[1], y.dtype)
