"""The small ops of an eager decode step, fused in C++ (`cpu_fused.cpp`), built on first use.

At one token a step's time is its weight reads plus a fixed cost per op: SmolLM2-135M's eager
batch-1 step dispatched ~1,500 aten ops (norms as pow/mean/rsqrt/mul, rotary as roll/mul/addcmul,
attention as index_copy_, views, a gather and SDPA), most of them parallel regions that wake
every thread for a few KB of work. These ops do each group in one call, on the calling thread
while the work is small:

- `rms_norm(x, w, eps)`: `model.layers.rms_norm` (x [T, n] or [T, R, n], w [n] or [R, n]);
- `add_rms_norm(x, d, w, eps)`: (x + d, rms_norm(x + d)), a residual add and the next norm;
- `rope(x, cos, sin, norm_w, eps)`: `model.rope.apply_rotary`, after Qwen3's per-head norm when given;
- `silu_mul(g, u)`: SwiGLU's silu(g) * u;
- `decode_attention(...)`: one query per sequence over the paged K/V cache, the cache write
  included (`engine.core.attention.PagedAttention`);
- `qkv_attention(...)`: `rope` of the q and k heads of a fused q/k/v output and
  `decode_attention` with its v heads, in one call (no slices or views of it in Python);
- `silu_mul_halves(gu)`: `silu_mul` of a fused gate/up output's two halves;
- `lora_addmm_(y, x, a, b)`: y += (x @ a.T) @ b, one adapter's delta on a few rows
  (`torch_backend`'s one-adapter decode step: two tiny GEMMs and three views before);
- `decode_layers(...)`: a `model.decode_plan.DecodePlan`'s whole loop over the decoder layers,
  the ops above and the projections' own (`cpu_gemv`, `cpu_quant`) called from C++;
- `screen_logits(logits)`: per row of a step's float32 logits, the index torch.argmax picks,
  or -1 where a value is NaN or Inf (the engine's non-finite screen and greedy pick, in one read).

Callers use them only where `usable(x)` holds: a CPU tensor of float32 or bfloat16 outside
autograd (serving: inference mode or no_grad) and outside a compiled graph (inductor fuses the
same ops itself), with the library built. Otherwise they run torch's ops, so the library is a
speed-up, never a requirement: no compiler, a failed build, or `LORASERVE_CPU_FUSED=0` leave
torch's path. Built and cached like `cpu_gemv` (kernels.cpp_build: per source, torch version
and CPU flags, in a directory only this user can change).
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import torch

from .tracing import compiling
from . import cpp_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_fused.cpp")
DTYPES = (torch.float32, torch.bfloat16)
_state: dict[str, bool] = {}


def available() -> bool:
    """Whether the fused ops are loaded (builds the library on the first call)."""
    return cpp_build.once(_state, "ok", _load)


def _load() -> bool:
    if os.environ.get("LORASERVE_CPU_FUSED", "1") == "0":
        return False
    try:
        cpp_build.load(cpp_build.library("cpu_fused", SOURCE, ("-ffp-contract=off",)))
        return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("fused CPU decode ops unavailable, torch's are used: %s", e)
        return False


def set_enabled(on: bool) -> None:
    """Turn the fused ops on or off in this process (benchmarks compare both in one run)."""
    if on:
        _state.pop("ok", None)
        available()
    else:
        _state["ok"] = False


def usable(x: torch.Tensor) -> bool:
    """Whether a step on `x` may take the fused ops: CPU, float32/bfloat16, no autograd, eager."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and not torch.is_grad_enabled()
            and not compiling() and available())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.loraserve_fused.rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.loraserve_fused.add_rms_norm(x, d, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_w: torch.Tensor | None = None,
         eps: float = 0.0) -> torch.Tensor:
    return torch.ops.loraserve_fused.rope(x, cos, sin, norm_w, eps)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.ops.loraserve_fused.silu_mul(g, u)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     slots: torch.Tensor, kv_index: torch.Tensor, lens: torch.Tensor, window: int,
                     scale: float) -> torch.Tensor:
    return torch.ops.loraserve_fused.decode_attention(q, k, v, kc, vc, slots, kv_index, lens, window, scale)


def qkv_attention(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  norm_w: torch.Tensor | None, eps: float, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
                  kv_index: torch.Tensor, lens: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """qkv [B, (heads + 2 kv_heads) D] -> [B, heads D]: `rope` then `decode_attention` (cpu_fused.cpp)."""
    return torch.ops.loraserve_fused.qkv_attention(qkv, heads, kv_heads, cos, sin, norm_w, eps, kc, vc, slots,
                                                   kv_index, lens, window, scale)


def silu_mul_halves(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] -> silu(gu[:, :I]) * gu[:, I:]."""
    return torch.ops.loraserve_fused.silu_mul_halves(gu)


LORA_MAX_ROWS = 8  # rows up to which `lora_addmm_` beats two GEMM calls (a decode step's few)


def lora_addmm_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.ops.loraserve_fused.lora_addmm_(y, x, a, b)


def screens(logits: torch.Tensor) -> bool:
    """Whether `screen_logits` takes `logits`: CPU float32 [B, V] with unit column stride, the library loaded."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and (logits.shape[1] <= 1 or logits.stride(1) == 1) and available())


def screen_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64: each row's torch.argmax, -1 where the row holds a NaN
    or Inf."""
    return torch.ops.loraserve_fused.screen_logits(logits)


def has_decode_layers() -> bool:
    """Whether `decode_layers` may run here: the library is loaded (its projections' kernels are
    checked by the plan that asks)."""
    return available()


def decode_layers(x: torch.Tensor, first_w: torch.Tensor, first_eps: float, weights: list[torch.Tensor],
                  proj: list[int], norms: list[torch.Tensor], meta: list[int], eps: list[float],
                  k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, kv_index: torch.Tensor, lens: torch.Tensor, scale: float,
                  lora: list[torch.Tensor], lora_meta: list[int]) -> torch.Tensor:
    """The decoder layers of one decode step (cpu_fused.cpp's `decode_layers` documents the lists)."""
    return torch.ops.loraserve_fused.decode_layers(x, first_w, first_eps, weights, proj, norms, meta, eps, k_layers,
                                                   v_layers, cos, sin, slots, kv_index, lens, scale, lora, lora_meta)
