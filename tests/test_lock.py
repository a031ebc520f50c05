"""The lock (requirements/lock.txt) is the venv: every range of pyproject.toml has a pin there that
satisfies it, and every pin is what this venv has installed. A pyproject change without
`make lock`, or a venv that was not installed from the lock, fails here rather than on a fresh
clone next month."""
from __future__ import annotations

import importlib.metadata
import re
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def pins() -> dict[str, Version]:
    found = {}
    for line in LOCK.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            found[canonicalize_name(m.group(1))] = Version(m.group(2))
    return found


def ranges() -> list[Requirement]:
    """Every requirement of the project and of the extras the Makefile installs (EXTRAS)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = re.search(r"^EXTRAS\s*:=\s*(.+)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    assert set(extras) <= set(project["optional-dependencies"]), extras
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def test_every_range_has_a_pin_that_satisfies_it() -> None:
    locked = pins()
    assert len(locked) > 100, "the lock holds the whole closure, transitive packages included"
    for req in ranges():
        name = canonicalize_name(req.name)
        assert name in locked, f"{req} has no pin in {LOCK.name}: run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"{req}: the lock pins {locked[name]}, outside the range: run `make lock`")


def test_the_venv_is_the_lock() -> None:
    """Over the venv's site-packages only: an imported setuptools puts its `_vendor` folder (with
    the dist-info of its own copies of packaging, platformdirs, ...) on sys.path."""
    site = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    installed = {canonicalize_name(d.metadata["Name"]): Version(d.version)
                 for d in importlib.metadata.distributions(path=site)}
    locked = pins()
    wrong = {n: (str(v), str(installed.get(n))) for n, v in locked.items() if installed.get(n) != v}
    assert not wrong, f"installed versions differ from the lock (pinned, installed): {wrong}"
    extra = sorted(set(installed) - set(locked) - {"loraserve"})
    assert not extra, f"installed but not in the lock: {extra}"


def test_the_lock_names_its_command_and_the_cpu_torch() -> None:
    text = LOCK.read_text()
    assert "make lock" in text.splitlines()[1]
    assert pins()["torch"].local == "cpu"  # never PyPI's CUDA build and its nvidia-* packages
    assert not any(name.startswith("nvidia-") for name in pins())
