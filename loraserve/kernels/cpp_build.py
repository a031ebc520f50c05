"""Our C++ CPU kernels, compiled here for this CPU and cached where only this user can change them.

`library(name, source, flags)` compiles `source` with the C++ compiler torch's own extensions
use (`-march=native`: the CPU's own instructions; `-fopenmp`: ATen's thread pool) into `<cache root>/<name>/<name>-<key>.so`,
the key a hash of the source, torch's version, the CPU's flags and the command, and returns the
file to load. The first process builds (under a lock: the others wait for its file); later ones
load the file. Used by `cpu_gemv` (one-row GEMV), `cpu_quant` (quantized linears) and `cpu_fused`
(decode ops), so every
library the server loads goes through the one check below.
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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
_LOADING = threading.RLock()  # one library's build and load at a time in a process


def once(state: dict, key: str, load: Callable[[], T]) -> T:
    """`state[key]`, set by `load()` (build and load a library, say what it offers) on the
    first call. A thread that asks while another loads waits for that answer: it must not read
    "unavailable" from a build still running, and take torch's path where it decides once."""
    if key not in state:
        with _LOADING:
            if key not in state:
                state[key] = load()
    return state[key]


_LOADED: set[str] = set()  # libraries loaded into this process


def load(lib: Path, register: Callable[[], None] = lambda: None) -> None:
    """Load a built library into this process once, then `register()` its ops' shape functions
    for compiled graphs: its ops cannot be loaded twice, and a second registration of a fake
    raises on some torch versions (2.11 on the GPU image)."""
    if str(lib) in _LOADED:
        return
    torch.ops.load_library(str(lib))
    register()
    _LOADED.add(str(lib))


def cache_root() -> Path:
    """$LORASERVE_CACHE_DIR, else $XDG_CACHE_HOME/loraserve, else ~/.cache/loraserve."""
    root = os.environ.get("LORASERVE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loraserve"
    return Path(root)


def cpu_flags() -> str:
    """The CPU's flags line of /proc/cpuinfo ("" where there is none): part of every key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library(name: str, source: Path, flags: tuple[str, ...] = ()) -> Path:
    """The built library of `source` for this torch and CPU: built now unless a trusted one is
    cached. OSError without a compiler; CalledProcessError when the build fails."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise OSError("no C++ compiler on PATH")
    from torch.utils import cpp_extension
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dir = Path(torch.__file__).parent / "lib"
    # -fopenmp always: ATen's at::parallel_for is an OpenMP pragma compiled into the caller, so a
    # library built without it runs every "parallel" loop on one thread, silently (cpu_quant did,
    # at half its speed on 2 cores, until tests/kernels/test_cpp_build.py checked it).
    cmd = [cxx, "-O3", "-march=native", "-fopenmp", *(f for f in flags if f != "-fopenmp"), "-std=c++17", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()),
           f"-I{sysconfig.get_paths()['include']}", str(source), f"-L{lib_dir}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{lib_dir}"]
    key = hashlib.sha256("\0".join([source.read_text(), torch.__version__, cpu_flags(), *cmd]).encode()).hexdigest()[:16]
    out = build_dir(cache_root() / name) / f"{name}-{key}.so"
    if trusted_file(out):
        return out
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait for its file
        if not trusted_file(out):
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            log.info("building %s (once per machine): %s", source.name, out)
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


def build_dir(path: Path) -> Path:
    """`path` if it is (or can be made) this user's alone, else a new private directory."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass
    if trusted_dir(path):
        return path
    private = Path(tempfile.mkdtemp(prefix=f"loraserve-{path.name}-"))  # mode 0700, this user's
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
