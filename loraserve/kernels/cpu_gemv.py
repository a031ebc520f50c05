"""One-row linears on the CPU at the memory's read bandwidth (`cpu_gemv.cpp`), built on first use.

A decode step that serves one sequence multiplies one row by every weight of the model: its
time is the time to read the weights. torch's one-row calls leave bandwidth unused (MKL's GEMM
on a column-major f32 weight, `torch.mv` on a bf16 one); `cpu_gemv.cpp` reads several weight
streams at once and reads 1.06x (f32) and 1.3x (bf16) faster than they do at 0.6B shapes on
the dev machine (medians of interleaved runs, bench/RESULTS.md). `vec_linear(x, weight)` is the op, `loraserve_cpu::vec_linear`,
registered with the dispatcher in C++: a compiled graph calls it without any Python in between.

The library is compiled here, for this CPU (`-march=native`), by the C++ compiler torch's own
extensions use, into a cache directory keyed by the source, torch's version and the CPU's
flags: the first process pays ~17 s, later ones load the file, once it, its SHA-256 recorded at
build time and the directory are checked to be this user's alone (`trusted_file`; a shared or
writable cache dir is not used: the library is built into a private 0700 directory instead). Where there is no compiler, no
AVX-512, or the build fails, `supports` answers False and callers keep torch's kernels: the
op is a speed-up, never a requirement. `LORASERVE_CPU_GEMV=0` turns it off.
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import torch

from . import cpp_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
_CAPS = {torch.float32: 1, torch.bfloat16: 2}
_state: dict[str, int] = {}


def cache_dir() -> Path:
    """Where built libraries go: $LORASERVE_CACHE_DIR, else $XDG_CACHE_HOME/loraserve, else ~/.cache/loraserve."""
    return cpp_build.cache_root() / "cpu_gemv"


def supports(dtype: torch.dtype) -> bool:
    """Whether `vec_linear` has a kernel for `dtype` weights here (builds the library on first call)."""
    return bool(_caps() & _CAPS.get(dtype, 0))


def reads_rows_once(dtype: torch.dtype) -> bool:
    """Whether `vec_linear` reads a row-major `dtype` weight once for 2-64 rows (float32 with
    AVX-512, bfloat16 with AVX512-BF16: wherever it has the one-row kernel)."""
    return dtype in (torch.float32, torch.bfloat16) and supports(dtype)


def vec_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight.T: x [M, in], weight [out, in] -> y [M, out]. One row: weight row-major, or
    column-major (f32). 2-64 rows over a row-major f32 or bf16 weight: read once for all rows (a
    decode batch pays one weight read, as one row does). Anything else: `torch.nn.functional.linear`'s
    GEMM, so every batch size may be sent here."""
    return torch.ops.loraserve_cpu.vec_linear(x, weight)


def _caps() -> int:
    return cpp_build.once(_state, "caps", _load_caps)


def _load_caps() -> int:
    if os.environ.get("LORASERVE_CPU_GEMV", "1") == "0":
        return 0
    try:
        cpp_build.load(_build(), lambda: torch.library.register_fake("loraserve_cpu::vec_linear")(
            lambda x, weight: x.new_empty((x.shape[0], weight.shape[0]))))
        return int(torch.ops.loraserve_cpu.caps())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU one-row kernels unavailable, torch's are used: %s", e)
        return 0


def build_dir() -> Path:
    """Where this kernel's library is built and cached (kernels.cpp_build.build_dir)."""
    return cpp_build.build_dir(cache_dir())


trusted_file = cpp_build.trusted_file  # the check every cached library passes before it is loaded


def _build() -> Path:
    """The library for this source, torch and CPU (built now unless a trusted one is cached)."""
    return cpp_build.library("cpu_gemv", SOURCE)
