"""Packaging: loraserve owns one top-level import name, and its layering is a checked contract.

Every package lives under loraserve/, `loraserve.kernels` and `loraserve.catalog` included. A
package named `kernels` exists on PyPI (compute kernels from the Hugging Face hub; transformers
imports it when installed), so a top-level `kernels` of ours would overwrite it or be overwritten. These tests build the real wheel, check
its file names, import it beside a stand-in `kernels` package (in the wheel and in this editable
install alike), and run import-linter's contracts from pyproject.toml over the built package.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
LINT = Path(PY).with_name("lint-imports")

# A stand-in for the PyPI package `kernels`: importable, and loud if loraserve ever uses it.
STAND_IN = '''
"""Stand-in for the Hugging Face hub's `kernels` package."""
IS_STAND_IN = True
def __getattr__(name):
    raise AttributeError(f"stand-in kernels package has no {name!r}: loraserve imported the wrong package")
'''

# Uses loraserve's kernels and catalog through every layer that imports them, then checks that
# the top-level name `kernels` is still the stand-in.
PROBE = textwrap.dedent('''
    import sys, torch
    import kernels
    assert kernels.IS_STAND_IN
    import loraserve.kernels as lk, loraserve.catalog.store, loraserve.catalog.format
    from loraserve.engine.core.build import build_engine
    from loraserve.lora.layers import LoRAState
    from loraserve.server.app import build_app
    assert lk is not kernels and not hasattr(lk, "IS_STAND_IN"), lk.__file__
    assert sys.modules["kernels"] is kernels, "loraserve replaced the top-level kernels module"
    assert "catalog" not in sys.modules, "loraserve imported a top-level catalog module"
    meta = lk.LoRAMeta.build(torch.tensor([0, 0, -1], dtype=torch.int32), max_segments=1)
    x, y = torch.randn(3, 8), torch.zeros(3, 4)
    A, B = torch.randn(2, 8), torch.randn(2, 4)
    table, ranks = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    lk.add_lora(y, x, A, B, table, ranks, meta, backend="torch")
    assert torch.allclose(y[:2], x[:2] @ A.T @ B, atol=1e-5) and not y[2].any()
    print("ok", lk.__file__)
''')


def _run(args: list[str], *, cwd: Path, path: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a private copy of the sources: setuptools writes build/ and *.egg-info into the
    tree it builds, and under xdist both workers may build at once (each runs this module-scoped
    fixture), so two builds in the repository itself would delete each other's files."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "loraserve", src / "loraserve", ignore=skip)
    proc = subprocess.run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (whl,) = out.glob("loraserve-*.whl")
    return whl


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked, as pip would install it, plus a stand-in `kernels` in another dir."""
    root = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root / "site")
    (root / "other" / "kernels").mkdir(parents=True)
    (root / "other" / "kernels" / "__init__.py").write_text(STAND_IN)
    return root


def test_wheel_installs_one_top_level_name(wheel) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"loraserve"}
    for folder in ("kernels", "catalog"):
        ours = {p.name for pattern in ("*.py", "*.cpp") for p in (REPO / "loraserve" / folder).glob(pattern)}
        shipped = {n.rsplit("/", 1)[1] for n in names if n.startswith(f"loraserve/{folder}/")}
        assert ours <= shipped, f"missing from loraserve/{folder}: {sorted(ours - shipped)}"
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "loraserve").rglob("__init__.py")}
    shipped_pkgs = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages <= shipped_pkgs, f"packages not in the wheel (pyproject's list): {packages - shipped_pkgs}"


def test_wheel_ships_the_demo_adapters(wheel) -> None:
    """`loraserve demo` imports the PEFT directories of loraserve/demo_adapters/ (package data)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    ours = {p.relative_to(REPO).as_posix() for p in (REPO / "loraserve" / "demo_adapters").rglob("*")
            if p.is_file() and p.suffix in (".json", ".safetensors", ".md")}
    assert any(n.endswith("/adapter_model.safetensors") for n in ours)
    assert ours <= names, f"missing from the wheel: {sorted(ours - names)}"


def test_wheel_ignores_a_foreign_kernels_package(site, tmp_path) -> None:
    proc = _run([PY, "-c", PROBE], cwd=tmp_path, path=[site / "other", site / "site"])
    assert proc.returncode == 0, proc.stderr
    assert str(site / "site") in proc.stdout


def test_editable_install_ignores_a_foreign_kernels_package(site, tmp_path) -> None:
    """The development install (setuptools' editable finder maps loraserve to this checkout)."""
    proc = _run([PY, "-c", PROBE], cwd=tmp_path, path=[site / "other"])
    assert proc.returncode == 0, proc.stderr
    assert str(REPO / "loraserve" / "kernels") in proc.stdout


def test_import_contracts_hold(site) -> None:
    """import-linter over the installed layout, the unpacked wheel (lint-imports puts its working
    directory first on the path, so it runs there, not in the repository)."""
    proc = _run([str(LINT), "--config", str(REPO / "pyproject.toml")], cwd=site / "site",
                path=[site / "site"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" not in proc.stdout.lower().replace("0 broken", "")


def test_every_module_has_a_layer() -> None:
    """A module the layers contract does not name is not checked by it: every top-level module
    and package of loraserve must be in one layer."""
    import tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    pkg = REPO / "loraserve"
    ours = {f"loraserve.{p.stem}" for p in pkg.glob("*.py") if p.stem != "__init__"}
    ours |= {f"loraserve.{p.parent.name}" for p in pkg.glob("*/__init__.py")}
    assert ours <= named, f"not in any layer of the import contract: {sorted(ours - named)}"
