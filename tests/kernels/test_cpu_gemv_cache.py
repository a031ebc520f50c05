"""The CPU kernel cache loads only what this user built (issue 43: a library planted in a shared
cache dir ran as the server). Planted files: no hash record, a wrong hash, a link, group- or
world-writable, another directory's mode, a library, record or directory of another user's; a
shared cache dir means a private build dir."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from loraserve.kernels import cpu_gemv


def _built(directory: Path, content: bytes = b"\x7fELF library bytes") -> Path:
    """A library as _build leaves it: the file and its SHA-256 record, both private."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    lib = directory / "cpu_gemv-0123456789abcdef.so"
    lib.write_bytes(content)
    lib.chmod(0o700)
    record = directory / (lib.name + ".sha256")
    record.write_text(hashlib.sha256(content).hexdigest())
    record.chmod(0o600)
    return lib


def test_a_library_built_here_is_trusted(tmp_path: Path) -> None:
    assert cpu_gemv.trusted_file(_built(tmp_path / "cache"))


OTHER_UID = 65534  # nobody


def _give_away(path: Path, monkeypatch) -> None:
    """`path` owned by another user, the files beside it left ours: chown as root; without
    the right to chown, the owner os.lstat reports for `path` (the stat the check reads)."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, -1, follow_symlinks=False)
        return
    real = os.lstat

    def lstat(target, *args, **kwargs):
        st = real(target, *args, **kwargs)
        if Path(target) != path:
            return st
        return os.stat_result((*st[:4], OTHER_UID, *st[5:10]))
    monkeypatch.setattr(os, "lstat", lstat)


@pytest.mark.parametrize("plant", ["no_record", "wrong_hash", "group_writable", "world_writable",
                                   "record_writable", "symlink", "dir_world_writable",
                                   "foreign_library", "foreign_record", "foreign_dir",
                                   "another_user_loads"])
def test_a_planted_library_is_not_loaded(tmp_path: Path, plant: str, monkeypatch) -> None:
    lib = _built(tmp_path / "cache")
    record = lib.with_name(lib.name + ".sha256")
    if plant == "no_record":
        record.unlink()
    elif plant == "wrong_hash":
        lib.write_bytes(b"another user's library")  # the name and record kept
    elif plant == "group_writable":
        lib.chmod(0o770)
    elif plant == "world_writable":
        lib.chmod(0o702)
    elif plant == "record_writable":
        record.chmod(0o666)
    elif plant == "symlink":
        target = _built(tmp_path / "elsewhere")
        lib.unlink()
        lib.symlink_to(target)
    elif plant == "dir_world_writable":
        lib.parent.chmod(0o777)
    elif plant.startswith("foreign_"):  # modes and hash as built: only the owner differs
        target = {"library": lib, "record": record, "dir": lib.parent}[plant.split("_")[1]]
        _give_away(target, monkeypatch)
    elif plant == "another_user_loads":  # files this user built, read by a process of another's
        monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    assert not cpu_gemv.trusted_file(lib)


def test_a_shared_cache_dir_means_a_private_build_dir(tmp_path: Path, monkeypatch) -> None:
    shared = tmp_path / "shared"
    (shared / "cpu_gemv").mkdir(parents=True)
    (shared / "cpu_gemv").chmod(0o777)  # anyone may plant a library here
    monkeypatch.setenv("LORASERVE_CACHE_DIR", str(shared))
    chosen = cpu_gemv.build_dir()
    assert chosen != shared / "cpu_gemv"
    st = os.lstat(chosen)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    chosen.rmdir()


def test_a_private_cache_dir_is_used_and_made_private(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LORASERVE_CACHE_DIR", str(tmp_path / "mine"))
    chosen = cpu_gemv.build_dir()
    assert chosen == tmp_path / "mine" / "cpu_gemv"
    assert os.lstat(chosen).st_mode & 0o777 == 0o700


def test_every_kernel_library_goes_through_the_one_check(tmp_path: Path, monkeypatch) -> None:
    """cpu_quant's library is built and loaded as cpu_gemv's (kernels.cpp_build): a private
    directory, a hash record, and a plant under its name is rebuilt, not loaded."""
    from loraserve.kernels import cpp_build, cpu_quant

    monkeypatch.setenv("LORASERVE_CACHE_DIR", str(tmp_path / "mine"))
    try:
        lib = cpu_quant._build()
    except OSError:  # no compiler here: nothing is built, nothing loaded
        return
    assert lib.parent == tmp_path / "mine" / "cpu_quant" and cpp_build.trusted_file(lib)
    lib.chmod(0o777)  # now writable by anyone: not trusted, so built again
    assert not cpp_build.trusted_file(lib)
    again = cpu_quant._build()
    assert again == lib and cpp_build.trusted_file(again)
