"""Launch plumbing shared by the Triton ops: interpreter selection and tile-size choice."""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1: Triton kernels may run (slowly) on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreted(kernel) -> bool:
    """Whether `kernel` was defined under TRITON_INTERPRET=1 (and so can run on CPU tensors).

    Triton fixes compiled vs interpreted when a kernel (or Triton's own library) is *defined*,
    so the variable must be set before `triton` is first imported.
    """
    return isinstance(kernel, InterpretedFunction)


def runnable(kernel, device: torch.device):
    """`kernel`, checked to be launchable on `device` (CPU needs the interpreter)."""
    if device.type != "cuda" and not interpreted(kernel):
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                           "triton is imported; use backend='torch' for the CPU path")
    return kernel


def dot_config(dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """Constexpr kwargs for the kernels' `tl.dot`.

    float32 inputs use exact IEEE products (TF32 would miss the 1e-4 tolerance). The Triton 3.x
    interpreter computes bfloat16 dots wrongly, so on CPU bf16 tiles are upcast to float32
    first (UPCAST); compiled kernels dot bf16/fp16 natively with float32 accumulation.
    """
    upcast = device.type != "cuda" and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return {"UPCAST": upcast, "PRECISION": precision}


def block_t(num_tokens: int, max_segments: int) -> int:
    """Tokens per program: 16 at decode sizes (segments hold a few tokens), larger for prefill."""
    per_segment = num_tokens / max(max_segments, 1)
    if num_tokens <= 256 or per_segment <= 16:
        return 16
    return 64


def block_k(h_in: int) -> int:
    """Shrink's reduction tile: wider for model-sized inputs (more bytes in flight per program)."""
    return 128 if h_in >= 2048 else 64


def block_n(h_out: int) -> int:
    """Expand's output tile: wider for model-sized outputs, 64 for small ones."""
    return 128 if h_out >= 1024 else 64


def split_k(h_in: int, block_k: int, num_tokens: int) -> int:
    """K splits for shrink: decode has few programs, so split the H_in reduction across more.

    Each split still walks at least 2 K blocks; partial sums meet in v with float32 atomics.
    """
    if num_tokens > 1024:
        return 1
    return max(1, min(32, triton.cdiv(h_in, block_k) // 2))
