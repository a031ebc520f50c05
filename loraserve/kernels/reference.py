"""Pure-torch oracles for the LoRA ops, written straight from the math, one token at a time.

They take the same arguments as the fast ops but read only `token_slots` / `token_experts`
(not the segment metadata), accumulate in float32 and are meant for tests, not speed.
Pool layout (see `kernels/__init__.py`): slot `a` owns pool rows `row_table[a, :ranks[a]]`;
`A[a] = A_rows[rows]` (`[r, H_in]`), `B[a] = B_rows[rows].T` (`[H_out, r]`); MoE pools carry an
expert axis after the row axis.
"""

from __future__ import annotations

import torch


def _adapter_rows(pool: torch.Tensor, row_table: torch.Tensor, ranks: torch.Tensor,
                  slot: int, expert: int) -> torch.Tensor:
    """The slot's `[r, H]` float32 rows of `pool` (expert plane `expert` for a 3-D MoE pool)."""
    rows = row_table[slot, : int(ranks[slot])].long()
    picked = pool[rows] if pool.dim() == 2 else pool[rows, expert]
    return picked.float()


def _token_keys(token_slots: torch.Tensor,
                token_experts: torch.Tensor | None) -> list[tuple[int, int, int]]:
    experts = [0] * token_slots.numel() if token_experts is None else token_experts.tolist()
    return [(t, a, e) for t, (a, e) in enumerate(zip(token_slots.tolist(), experts)) if a >= 0]


def shrink_ref(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
               ranks: torch.Tensor, token_slots: torch.Tensor,
               token_experts: torch.Tensor | None = None) -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for every token t with slot a = token_slots[t] >= 0.

    v [T, R_max] (written in place, other entries untouched), x [T, H_in], A_rows [P, H_in] or
    [P, E, H_in], row_table [A, R_max] int32, ranks [A] int32, token_slots / token_experts [T].
    """
    for t, a, e in _token_keys(token_slots, token_experts):
        r = int(ranks[a])
        if r:
            A = _adapter_rows(A_rows, row_table, ranks, a, e)
            v[t, :r] = (A @ x[t].float()).to(v.dtype)


def expand_ref(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
               ranks: torch.Tensor, token_slots: torch.Tensor,
               token_experts: torch.Tensor | None = None) -> None:
    """y[t] += v[t, :r(a)] @ B[a]^T for every token t with slot a >= 0 (in place, fp32 math).

    y [T, H_out], v [T, R_max], B_rows [P, H_out] or [P, E, H_out] (B transposed: one row per
    rank index), row_table [A, R_max] int32, ranks [A] int32, token_slots / token_experts [T].
    """
    for t, a, e in _token_keys(token_slots, token_experts):
        r = int(ranks[a])
        if r:
            Bt = _adapter_rows(B_rows, row_table, ranks, a, e)  # [r, H_out]
            y[t] = (y[t].float() + v[t, :r].float() @ Bt).to(y.dtype)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                 row_table: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor,
                 token_experts: torch.Tensor | None = None) -> None:
    """y[t] += B[a] @ (A[a] @ x[t]) per LoRA token; for MoE pairs with expert e: B[a, e] A[a, e].

    The intermediate stays float32, so this is the exact-as-possible oracle for `add_lora`.
    """
    v = torch.zeros(x.shape[0], row_table.shape[1], dtype=torch.float32, device=x.device)
    shrink_ref(v, x, A_rows, row_table, ranks, token_slots, token_experts)
    expand_ref(y, v, B_rows, row_table, ranks, token_slots, token_experts)


def moe_lora_ref(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                 row_table: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor,
                 token_experts: torch.Tensor) -> None:
    """MoE `add_lora_ref`: y_e[p] += B[a, e] @ (A[a, e] @ x[p]) per (token, expert) pair p.

    x [T*k, H_in] (gathered per pair), y [T*k, H_out], A_rows [P, E, H_in], B_rows [P, E, H_out].
    """
    if A_rows.dim() != 3 or B_rows.dim() != 3:
        raise ValueError("moe_lora_ref needs 3-D [P, E, H] pools")
    add_lora_ref(y, x, A_rows, B_rows, row_table, ranks, token_slots, token_experts)
