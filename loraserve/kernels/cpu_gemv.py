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

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sysconfig
import tempfile
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


def reads_rows_once(dtype: torch.dtype) -> bool:
    """Whether `vec_linear` reads a row-major `dtype` weight once for 2-64 rows (float32 with AVX-512)."""
    return dtype == torch.float32 and supports(dtype)


def vec_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight.T: x [M, in], weight [out, in] -> y [M, out]. One row: weight row-major, or
    column-major (f32). 2-64 rows over a row-major f32 weight: read once for all rows (a
    decode batch pays one weight read, as one row does). Anything else: `torch.nn.functional.linear`'s
    GEMM, so every batch size may be sent here."""
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
    torch.library.register_fake("loraserve_cpu::vec_linear")(lambda x, weight: x.new_empty((x.shape[0], weight.shape[0])))
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
    out = build_dir() / f"cpu_gemv-{key}.so"
    if trusted_file(out):
        return out
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait for its file
        if not trusted_file(out):
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            log.info("building the CPU one-row kernels (once per machine): %s", out)
            subprocess.run([*cmd, "-o", str(tmp)], check=True, capture_output=True, timeout=600)
            os.chmod(tmp, 0o700)
            _write_private(_digest_path(out), _digest(tmp))  # the hash loads are checked against
            os.replace(tmp, out)
    return out


# -- the cache is trusted only as far as it is ours ----------------------------------------------
#
# A library in the cache runs as this process. One is loaded only if it, its recorded SHA-256
# (`<lib>.sha256`, written when it was built) and the directory are all owned by this user and
# writable by no one else, and its bytes hash to the record; anything else is rebuilt. A cache
# directory that fails the test (shared, group- or world-writable, another user's) is not used:
# the library is built into a private directory of this process's (mode 0700) instead.


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def trusted_dir(path: Path) -> bool:
    """`path` is a real directory (no link), this user's, writable by no one else."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _ours(st)


def trusted_file(lib: Path) -> bool:
    """`lib` may be loaded: a regular file (no link) and its hash record, both this user's and
    writable by no one else, in a trusted directory, and its bytes hash to the record."""
    record = _digest_path(lib)
    try:
        sts = os.lstat(lib), os.lstat(record)
    except OSError:
        return False
    if not trusted_dir(lib.parent) or not all(stat.S_ISREG(st.st_mode) and _ours(st) for st in sts):
        log.warning("not loading %s: it or its hash record is not this user's alone; rebuilding", lib)
        return False
    if record.read_text().strip() != _digest(lib):
        log.warning("not loading %s: its bytes do not hash to the recorded SHA-256; rebuilding", lib)
        return False
    return True


def build_dir() -> Path:
    """`cache_dir()` if it is (or can be made) this user's alone, else a new private directory."""
    path = cache_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass
    if trusted_dir(path):
        return path
    private = Path(tempfile.mkdtemp(prefix="loraserve-cpu-gemv-"))  # mode 0700, this user's
    log.warning("the kernel cache %s is not this user's alone; building into %s", path, private)
    return private


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
