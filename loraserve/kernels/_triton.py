"""Interpreter plumbing shared by the Triton ops (tile choice lives in `launch.py`)."""

from __future__ import annotations

import os

import torch
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
