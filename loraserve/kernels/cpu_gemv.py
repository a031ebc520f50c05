"""One-row linears on the CPU at the memory's read bandwidth (`cpu_gemv.cpp`), built on first use.

A decode step that serves one sequence multiplies one row by every weight of the model: its
time is the time to read the weights. torch's one-row calls leave bandwidth unused (MKL's GEMM
on a column-major f32 weight, `torch.mv` on a bf16 one); `cpu_gemv.cpp` reads several weight
streams at once and reads 1.06x (f32) and 1.3x (bf16) faster than they do at 0.6B shapes on
the dev machine (medians of interleaved runs, bench/RESULTS.md). `vec_linear(x, weight)` is the op, `loraserve_cpu::vec_linear`,
registered with the dispatcher in C++: a compiled graph calls it without any Python in between.

The library is compiled here, for this CPU (`-march=native`), by the C++ compiler torch's own
extensions use, into a cache directory keyed by the source, torch's version and the CPU's
flags: the first process pays ~17 s, later ones load the file. Where there is no compiler, no
AVX-512, or the build fails, `supports` answers False and callers keep torch's kernels: the
op is a speed-up, never a requirement. `LORASERVE_CPU_GEMV=0` turns it off.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
_CAPS = {torch.float32: 1, torch.bfloat16: 2}
_state: dict[str, int] = {}


def cache_dir() -> Path:
    """Where built libraries go: $LORASERVE_CACHE_DIR, else $XDG_CACHE_HOME/loraserve, else ~/.cache/loraserve."""
    root = os.environ.get("LORASERVE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loraserve"
    return Path(root) / "cpu_gemv"


def supports(dtype: torch.dtype) -> bool:
    """Whether `vec_linear` has a kernel for `dtype` weights here (builds the library on first call)."""
    return bool(_caps() & _CAPS.get(dtype, 0))


def vec_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, in] @ weight [out, in].T -> [1, out]; weight row-major, or column-major (f32)."""
    return torch.ops.loraserve_cpu.vec_linear(x, weight)


def _caps() -> int:
    if "caps" not in _state:
        _state["caps"] = 0
        if os.environ.get("LORASERVE_CPU_GEMV", "1") != "0":
            try:
                _load(_build())
                _state["caps"] = int(torch.ops.loraserve_cpu.caps())
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.warning("CPU one-row kernels unavailable, torch's are used: %s", e)
    return _state["caps"]


_loaded: set[str] = set()  # libraries loaded into this process (a loaded op cannot be loaded again)


def _load(lib: Path) -> None:
    """Load `lib` and give its op a shape function for compiled graphs, once per process: a
    second registration of the fake raises on some torch versions (2.11 on the GPU image)."""
    if str(lib) in _loaded:
        return
    torch.ops.load_library(str(lib))
    torch.library.register_fake("loraserve_cpu::vec_linear")(lambda x, weight: x.new_empty((1, weight.shape[0])))
    _loaded.add(str(lib))


def _flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build() -> Path:
    """The library for this source, torch and CPU: built now unless already in `cache_dir`."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise OSError("no C++ compiler on PATH")
    from torch.utils import cpp_extension
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dir = Path(torch.__file__).parent / "lib"
    cmd = [cxx, "-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()),
           f"-I{sysconfig.get_paths()['include']}", str(SOURCE), f"-L{lib_dir}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{lib_dir}"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, _flags(), *cmd]).encode()).hexdigest()[:16]
    out = cache_dir() / f"cpu_gemv-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait for its file
        if not out.exists():
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            log.info("building the CPU one-row kernels (once per machine): %s", out)
            subprocess.run([*cmd, "-o", str(tmp)], check=True, capture_output=True, timeout=600)
            os.replace(tmp, out)
    return out
