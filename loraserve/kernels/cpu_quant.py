"""Weight-only quantized linears on the CPU (`cpu_quant.cpp`), built on first use.

`quant_linear(x, codes, scales, mins, bits, group)` multiplies float32 rows x [M, K] by a weight
held in model/quant.py's layout (unsigned 4- or 8-bit codes, float16 scale and min per group),
each weight made in registers as `dequantize` makes it (a 4-bit code through a 16-entry table of
its group's weights): a one-row step reads 5-6 bits a weight instead of 32, and the product is
the dequantized weight's up to float summation order (bench/quant_kernels.py has the table
against torch's own packed matmuls and the kernel this one replaced). `int8_acts=True` runs the
AVX512-VNNI variant instead, activations rounded to int8 per 32 inputs as llama.cpp does; less
exact (cpu_quant.cpp), it is kept for the bench. It is registered with the dispatcher in C++
(`loraserve_quant::quant_linear`), with a fake for torch.compile's graphs.

Built by `kernels.cpp_build` as `cpu_gemv` is, for this CPU (`-march=native`), into the same cache root keyed by the
source, torch's version and the CPU's flags, loaded only once it passes the same ownership and hash check. Without a compiler, AVX512-VNNI or F16C, or when the
build fails, `available()` is False and `QuantLinear` dequantizes into a float GEMM instead: the
op is a speed-up, never a requirement. `LORASERVE_CPU_QUANT=0` turns it off.
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import torch

from . import cpp_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant.cpp")
_state: dict[str, int] = {}


def available() -> bool:
    """Whether `quant_linear` runs here (builds the library on the first call)."""
    return bool(cpp_build.once(_state, "caps", _load_caps))


def _load_caps() -> int:
    if os.environ.get("LORASERVE_CPU_QUANT", "1") == "0":
        return 0
    try:
        cpp_build.load(_build(), _register_fakes)
        return int(torch.ops.loraserve_quant.caps())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU quantized kernels unavailable, quantized bases dequantize per call: %s", e)
        return 0


def _register_fakes() -> None:
    torch.library.register_fake("loraserve_quant::quant_linear")(
        lambda x, codes, scales, mins, bits, group, int8_acts: x.new_empty((x.shape[0], codes.shape[0])))
    torch.library.register_fake("loraserve_quant::dequantize")(
        lambda codes, scales, mins, bits, k, group: scales.new_empty((codes.shape[0], k), dtype=torch.float32))


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bits: int, group: int, int8_acts: bool = False) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 through the packed weight (see the module doc); with
    int8_acts the activations are rounded to int8 per 32 inputs first (the VNNI kernel)."""
    return torch.ops.loraserve_quant.quant_linear(x, codes, scales, mins, bits, group, int8_acts)


# The kernels `quant_linear_kernel` can run (cpu_quant.cpp's `Kernel`): "table", the one
# `quant_linear` serves; "float-v1", the float-activation kernel it replaced; "int8-acts", the
# VNNI kernel (int8_acts=True). For bench/quant_kernels.py and the tests, which compare them.
KERNEL_IDS = {"table": 0, "float-v1": 1, "int8-acts": 2}


def quant_linear_kernel(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                        bits: int, group: int, kernel: str, streams: int = 4, ahead: int = 8192) -> torch.Tensor:
    """`quant_linear` through a named kernel of KERNEL_IDS; for "table", `streams` output rows read
    at once (2 or 8; any other value reads 4) and `ahead` bytes prefetched in front of each (0:
    none). The defaults are what `quant_linear` serves."""
    return torch.ops.loraserve_quant.quant_linear_kernel(x, codes, scales, mins, bits, group, KERNEL_IDS[kernel],
                                                         streams, ahead)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, k: int,
               group: int) -> torch.Tensor:
    """The float32 [N, k] weight the packed codes stand for (prefill's GEMM reads it)."""
    return torch.ops.loraserve_quant.dequantize(codes, scales, mins, bits, k, group)


def _build() -> Path:
    """The library for this source, torch and CPU (built now unless a trusted one is cached)."""
    return cpp_build.library("cpu_quant", SOURCE)
