"""Segmented-gather LoRA (SGMV) ops: one batch, many adapters, mixed ranks, dense and MoE targets.

Semantics per LoRA target (`T` tokens, slot `a(t)`, `-1` = base only):

    shrink:   v[t, :r(a)] = x[t] @ A[a]^T
    expand:   y[t] += v[t, :r(a)] @ B[a]^T        (LoRA scale already folded into B)
    add_lora: y[t] += B[a] @ (A[a] @ x[t])        (MoE: per (token, expert) pair, B[a,e] A[a,e])

Pool layout: rank rows (docs/INTERNALS.md section 2). Per target and layer the weights live in
row pools `A_rows [P, H_in]` and `B_rows [P, H_out]` (B transposed: one row per rank index;
MoE: `[P, E, H_in]` / `[P, E, H_out]`). Slot `a` owns the `ranks[a]` pool rows
`row_table[a, :ranks[a]]` anywhere in the pool, so `A[a] = A_rows[rows]` and
`B[a] = B_rows[rows].T`. A rank-4 adapter holds 4 rows next to a rank-64 one holding 64: weight
memory is exactly the sum of the resident ranks, with zero padding. The only waste is the row
table (`A * R_max` int32 per target kind, shared by all layers); its unused entries are at most
`A * R_max * 4` bytes per kind (every slot empty), e.g. 64 KiB for 256 slots at R_max 64.

Work scales with each slot's own rank: the Triton kernels tile rank in BLOCK_R = 16 masked
blocks up to `ranks[a]` (a rank-4 slot loads 4 rows and computes one 16-wide block, a rank-64
slot four blocks; never R_max). The torch backend computes its gathered (decode) tokens at the
largest rank among them and its heavy segments at their exact rank.

Metadata (`LoRAMeta.build`) is prepared once per step (per layer for MoE routing) on the device
with no host sync, optionally into preallocated buffers (`LoRAMeta.empty`). `max_segments` bounds
the distinct (slot, expert) keys: `A` for dense targets, `A * E` for MoE (never more than T).
Kernels launch over the first `min(S_max, T)` segments and skip unused ones, so launch shapes
depend only on `T` and `S_max` (CUDA-graph friendly).

The rank-space intermediate `v` is `[T, R_max]` float32 (the activation dtype is accepted too);
`shrink` zeroes it and writes `v[t, :r(a)]`, so every other entry is 0.

Tiling: `launch.LaunchConfig.pick` chooses every tile size, K split and grid of a launch from
(op, T, H, R_max, S_max, dtype, device); the launchers take its choice as is.

Custom ops: `shrink`, `expand` and `add_lora` are registered as `torch.ops.loraserve.*`
(in-place outputs in `mutates_args`, fake implementations), so `torch.compile` traces a model
that calls them without a graph break (see `ops.py`).

Backends: `resolve_backend("auto" | "triton" | "torch", device)`; "auto" is Triton on CUDA and
torch elsewhere; Triton on CPU needs TRITON_INTERPRET=1 (tests only). `LoRAOps(backend, device)`
resolves it once and calls the ops on that backend (the engine's); the module functions take a
`backend=` name and resolve it per call. `reference.py` holds the
per-token float32 oracles.
"""

from .backend import BACKENDS, resolve_backend
from .expand import expand_triton
from .launch import LaunchConfig
from .meta import LoRAMeta
from .ops import LoRAOps, add_lora, expand, shrink
from .shrink import shrink_triton
from .torch_backend import add_lora_torch, plan_torch

__all__ = [
    "BACKENDS", "LaunchConfig", "LoRAMeta", "LoRAOps", "add_lora", "add_lora_torch", "expand",
    "expand_triton", "plan_torch", "resolve_backend", "shrink", "shrink_triton",
]
