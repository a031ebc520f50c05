"""Public LoRA ops: one entry point per op, dispatching to the Triton or torch backend.

Each op is also a torch custom op (`torch.ops.loraserve.shrink`, `.expand`, `.add_lora`) with
its in-place outputs declared in `mutates_args` and a fake implementation, so `torch.compile`
(and `torch.export`) can trace a model that calls them without a graph break. Custom ops take
tensors, ints, bools, strings and lists, not a `LoRAMeta`: the meta travels as its seven buffers
(`meta.tensors()`) plus `num_tokens` and `moe`, and the implementation rebuilds it.

The public functions call the registered op while a compiler traces them (or any
TorchDispatchMode, e.g. FakeTensorMode, is active). Plain eager calls run the same
implementation directly: the custom-op dispatcher costs tens of microseconds a call in torch 2.13
(argument parsing and default filling in Python), more than a Triton launch, and the server runs
eagerly.

The backend is chosen once per device: `LoRAOps(backend, device)` resolves it when the engine
builds its model and its methods dispatch on the resolved name; the module functions take
`backend="auto" | "triton" | "torch"` and resolve it on each call (for direct callers: tests,
benchmarks). The implementations and the custom ops' bodies take a resolved name ("triton" or
"torch"; "auto" is resolved there too, for a caller of `torch.ops.loraserve.*`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .tracing import compiling
from ._checks import check_expand, check_shrink
from .backend import BACKENDS, resolve_backend
from .expand import expand_triton
from .meta import LoRAMeta
from .shrink import shrink_triton
from .torch_backend import add_lora_torch, expand_torch, shrink_torch


class LoRAOps:
    """`shrink`, `expand` and `add_lora` with the backend resolved once for one device (the
    engine's `LoRAState` holds one): the calls never resolve it again."""

    __slots__ = ("backend", "device")

    def __init__(self, backend: str, device: torch.device | str):
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)  # "triton" or "torch"

    def shrink(self, v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor,
               row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta) -> None:
        """`shrink` on this backend."""
        _shrink(v, x, A_rows, row_table, ranks, meta, self.backend)

    def expand(self, y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor,
               row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta) -> None:
        """`expand` on this backend."""
        _expand(y, v, B_rows, row_table, ranks, meta, self.backend)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor,
                 B_rows: torch.Tensor, row_table: torch.Tensor, ranks: torch.Tensor,
                 meta: LoRAMeta, *, buffer: torch.Tensor | None = None, plan=None) -> None:
        """`add_lora` on this backend."""
        _add_lora(y, x, A_rows, B_rows, row_table, ranks, meta, self.backend, buffer, plan)


def shrink(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
           ranks: torch.Tensor, meta: LoRAMeta, *, backend: str = "auto") -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for each token t with slot a >= 0; every other v entry := 0.

    v [T, R_max] float32 (recommended; x's dtype also accepted), written in place;
    x [T, H_in] float32 / bfloat16 / float16, read; A_rows [P, H_in] (MoE: [P, E, H_in]) in x's
    dtype, read; row_table [A, R_max] int32, read; ranks [A] int32 (0 = slot has no LoRA on this
    target), read; meta from `LoRAMeta.build` for these T tokens.
    """
    _shrink(v, x, A_rows, row_table, ranks, meta, _resolved(backend, x))


def expand(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
           ranks: torch.Tensor, meta: LoRAMeta, *, backend: str = "auto") -> None:
    """y[t] += v[t, :r(a)] @ B[a]^T for each token t with slot a >= 0 (scale folded into B).

    y [T, H_out] float32 / bfloat16 / float16, updated in place (unit column stride, any row
    stride); v [T, R_max] float32 or y's dtype from `shrink`, read; B_rows [P, H_out]
    (MoE: [P, E, H_out]) in y's dtype, i.e. B transposed, read; row_table [A, R_max] int32 and
    ranks [A] int32, read; meta from `LoRAMeta.build`.
    """
    _expand(y, v, B_rows, row_table, ranks, meta, _resolved(backend, y))


def add_lora(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
             row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta, *,
             backend: str = "auto", buffer: torch.Tensor | None = None, plan=None) -> None:
    """y[t] += B[a] @ (A[a] @ x[t]) for each LoRA token (MoE pairs: B[a, e] @ A[a, e]).

    y [T, H_out], updated in place; x [T, H_in], read; A_rows [P, H_in] / B_rows [P, H_out]
    (MoE: [P, E, H]) in x's dtype, read; row_table [A, R_max] int32 and ranks [A] int32, read.
    buffer: optional [T, R_max] float32 scratch for the rank-space intermediate (Triton only;
    allocated when None; pass a preallocated one under CUDA graphs), overwritten.
    plan: torch backend only, from `plan_torch` (built once per step and target kind); an eager
    host-side shortcut, dropped while a compiler traces the call (the op plans for itself).
    """
    _add_lora(y, x, A_rows, B_rows, row_table, ranks, meta, _resolved(backend, x), buffer, plan)


def _resolved(backend: str, t: torch.Tensor) -> str:
    """The module functions' backend for `t`'s device; the name as given while the ops trace
    (their fake implementations check it and touch no device)."""
    return backend if _through_op() else resolve_backend(backend, t.device)


def _shrink(v, x, A_rows, row_table, ranks, meta: LoRAMeta, backend: str) -> None:
    if _through_op():
        torch.ops.loraserve.shrink(v, x, A_rows, row_table, ranks, meta.tensors(),
                                   _op_tokens(meta, x), meta.moe, backend)
    else:
        _shrink_impl(v, x, A_rows, row_table, ranks, meta, backend)


def _expand(y, v, B_rows, row_table, ranks, meta: LoRAMeta, backend: str) -> None:
    if _through_op():
        torch.ops.loraserve.expand(y, v, B_rows, row_table, ranks, meta.tensors(),
                                   _op_tokens(meta, v), meta.moe, backend)
    else:
        _expand_impl(y, v, B_rows, row_table, ranks, meta, backend)


def _add_lora(y, x, A_rows, B_rows, row_table, ranks, meta: LoRAMeta, backend: str,
              buffer: torch.Tensor | None, plan) -> None:
    if _through_op():
        torch.ops.loraserve.add_lora(y, x, A_rows, B_rows, row_table, ranks, buffer,
                                     meta.tensors(), _op_tokens(meta, x), meta.moe, backend)
    else:
        _add_lora_impl(y, x, A_rows, B_rows, row_table, ranks, meta, backend, buffer, plan)


def _op_tokens(meta: LoRAMeta, x: torch.Tensor) -> int:
    """num_tokens for the op: x's row count for dense targets (equal by contract), so a graph
    compiled with dynamic shapes keeps it symbolic instead of specialising on the int."""
    return meta.num_tokens if meta.moe else x.shape[0]


def _through_op() -> bool:
    """Call the registered custom op (not the implementation directly): while torch.compile /
    export traces the caller, or under a TorchDispatchMode (FakeTensorMode, make_fx, ...)."""
    return compiling() or _get_current_dispatch_mode() is not None


# -- implementations (the custom ops' bodies): `backend` is a resolved name -------------------

_RESOLVED = ("triton", "torch")


def _shrink_impl(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta, backend: str) -> None:
    if backend not in _RESOLVED:
        backend = resolve_backend(backend, x.device)
    if backend == "triton":
        shrink_triton(v, x, A_rows, row_table, ranks, meta)
    else:
        shrink_torch(v, x, A_rows, row_table, ranks, meta)


def _expand_impl(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta, backend: str) -> None:
    if backend not in _RESOLVED:
        backend = resolve_backend(backend, y.device)
    if backend == "triton":
        expand_triton(y, v, B_rows, row_table, ranks, meta)
    else:
        expand_torch(y, v, B_rows, row_table, ranks, meta)


def _add_lora_impl(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                   row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta, backend: str,
                   buffer: torch.Tensor | None, plan=None) -> None:
    if backend not in _RESOLVED:
        backend = resolve_backend(backend, x.device)
    if backend == "triton":
        if buffer is None:
            buffer = torch.empty(x.shape[0], row_table.shape[1], dtype=torch.float32,
                                 device=x.device)
        shrink_triton(buffer, x, A_rows, row_table, ranks, meta)
        expand_triton(y, buffer, B_rows, row_table, ranks, meta)
    else:
        add_lora_torch(y, x, A_rows, B_rows, row_table, ranks, meta, plan=plan)


# -- torch custom ops ----------------------------------------------------------------------------


@torch.library.custom_op("loraserve::shrink", mutates_args=("v",))
def _shrink_op(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
               ranks: torch.Tensor, meta_tensors: list[torch.Tensor], num_tokens: int, moe: bool,
               backend: str) -> None:
    """`shrink` as a custom op: the meta as `LoRAMeta.tensors()`, num_tokens, moe."""
    _shrink_impl(v, x, A_rows, row_table, ranks, LoRAMeta(*meta_tensors, num_tokens, moe),
                 backend)


@torch.library.custom_op("loraserve::expand", mutates_args=("y",))
def _expand_op(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
               ranks: torch.Tensor, meta_tensors: list[torch.Tensor], num_tokens: int, moe: bool,
               backend: str) -> None:
    """`expand` as a custom op: the meta as `LoRAMeta.tensors()`, num_tokens, moe."""
    _expand_impl(y, v, B_rows, row_table, ranks, LoRAMeta(*meta_tensors, num_tokens, moe),
                 backend)


@torch.library.custom_op("loraserve::add_lora", mutates_args=("y", "buffer"))
def _add_lora_op(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                 row_table: torch.Tensor, ranks: torch.Tensor, buffer: torch.Tensor | None,
                 meta_tensors: list[torch.Tensor], num_tokens: int, moe: bool,
                 backend: str) -> None:
    """`add_lora` as a custom op (no torch-backend plan: the op plans for itself)."""
    _add_lora_impl(y, x, A_rows, B_rows, row_table, ranks,
                   LoRAMeta(*meta_tensors, num_tokens, moe), backend, buffer)


# Fake (meta) implementations: no output to allocate (every result is written in place); they
# run the launchers' shape / dtype / device checks, so bad input fails while tracing.


@_shrink_op.register_fake
def _(v, x, A_rows, row_table, ranks, meta_tensors, num_tokens, moe, backend) -> None:
    _check_backend_name(backend)
    check_shrink(v, x, A_rows, row_table, ranks, LoRAMeta(*meta_tensors, num_tokens, moe))


@_expand_op.register_fake
def _(y, v, B_rows, row_table, ranks, meta_tensors, num_tokens, moe, backend) -> None:
    _check_backend_name(backend)
    check_expand(y, v, B_rows, row_table, ranks, LoRAMeta(*meta_tensors, num_tokens, moe))


@_add_lora_op.register_fake
def _(y, x, A_rows, B_rows, row_table, ranks, buffer, meta_tensors, num_tokens, moe,
      backend) -> None:
    _check_backend_name(backend)
    meta = LoRAMeta(*meta_tensors, num_tokens, moe)
    v = buffer if buffer is not None else x.new_empty(x.shape[0], row_table.shape[1],
                                                      dtype=torch.float32)
    check_shrink(v, x, A_rows, row_table, ranks, meta)
    check_expand(y, v, B_rows, row_table, ranks, meta)


def _check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of {', '.join(BACKENDS)}")
