"""No name the checkout lays out may shadow, or be shadowed by, an installed distribution.

A Python started in the repository's root has the root first on `sys.path`; pytest (prepend
mode) puts tests/ and the test folders without an `__init__.py` there too. A folder or module in
one of those directories named like a top-level package of an installed distribution decides
which of the two an `import` finds by the order of `sys.path`: a top-level `kernels/` of ours
once made transformers import it instead of the PyPI package `kernels` (58 failures and 232
errors on a fresh clone). This test lists both sides and fails on any overlap, so the next
release that brings a new top-level name is caught here, not by a user.

In the root every name counts, folders without an `__init__.py` included (`docker/` would be a
namespace package that an installed regular package `docker` hides, and anything importing ours
by that name would get theirs). In the folders pytest adds, test folders are never imported by
their own name, so there a namespace folder counts only against a distribution whose own
top-level name is itself a namespace package (the two would merge); modules and packages always
count.
"""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import inspect
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = "loraserve"  # the one top-level name the project owns, from its own distribution
IMPORTABLE = (".py", ".pyc", ".so", ".pyd")  # files that make their folder, or themselves, importable


def laid_out(folder: Path) -> dict[str, str]:
    """Top-level import names `folder` offers when it is on sys.path: name -> "module",
    "package" or "namespace"."""
    names: dict[str, str] = {}
    for entry in folder.iterdir():
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_dir():
            if entry.name.isidentifier():
                names[entry.name] = "package" if (entry / "__init__.py").exists() else "namespace"
        elif entry.suffix in IMPORTABLE:
            stem = entry.name.split(".", 1)[0]
            if stem.isidentifier():
                names[stem] = "module"
    return names


def pytest_roots(tests: Path) -> set[Path]:
    """The folders pytest's prepend import mode puts on sys.path for this suite: for every test
    module and conftest, the first folder above its package chain (its own folder when it is
    not in a package)."""
    roots = set()
    for path in list(tests.rglob("test_*.py")) + list(tests.rglob("conftest.py")):
        folder = path.parent
        while (folder / "__init__.py").exists():
            folder = folder.parent
        roots.add(folder)
    return roots


def installed_names(dists: Iterable[importlib.metadata.Distribution]) -> dict[str, set[str]]:
    """Top-level import name -> the distributions that install it: what
    `importlib.metadata.packages_distributions()` computes, over the given distributions."""
    names: dict[str, set[str]] = {}
    for dist in dists:
        tops = (dist.read_text("top_level.txt") or "").split() or [
            f.parts[0] if len(f.parts) > 1 else inspect.getmodulename(f.name) or ""
            for f in dist.files or () if f.suffix in IMPORTABLE]
        for top in tops:
            if top.isidentifier() and top != "__pycache__":
                names.setdefault(top, set()).add(dist.metadata["Name"])
    return names


def is_namespace(name: str) -> bool:
    """Whether the installed top-level `name` is a namespace package, looked up with the
    checkout's folders off the path."""
    ours = {REPO, *pytest_roots(REPO / "tests")}
    path = [p for p in sys.path if p and Path(p).resolve() not in ours]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    return spec is not None and spec.origin in (None, "namespace")


def collisions(repo: Path, installed: Mapping[str, set[str]]) -> list[str]:
    """Each overlap between a name the checkout lays out and an installed distribution's."""
    found = []
    places = [(repo, True)] + [(root, False) for root in sorted(pytest_roots(repo / "tests"))]
    for folder, every_name in places:
        for name, kind in sorted(laid_out(folder).items()):
            dists = installed.get(name, set()) - ({"loraserve"} if name == OURS else set())
            if not dists or (kind == "namespace" and not every_name and not is_namespace(name)):
                continue
            where = "" if folder == repo else folder.relative_to(repo).as_posix() + "/"
            found.append(f"{where}{name} ({kind}) is also installed by {', '.join(sorted(dists))}")
    return found


@pytest.fixture(scope="module")
def venv_names() -> dict[str, set[str]]:
    return installed_names(importlib.metadata.distributions())


def with_dummy(venv_names: Mapping[str, set[str]], site: Path) -> dict[str, set[str]]:
    """The venv's names plus those of the distributions installed into `site`."""
    names = {name: set(dists) for name, dists in venv_names.items()}
    for name, dists in installed_names(importlib.metadata.distributions(path=[str(site)])).items():
        names.setdefault(name, set()).update(dists)
    return names


def test_no_name_in_the_checkout_is_an_installed_distributions(venv_names) -> None:
    installed = venv_names
    assert OURS in installed, "loraserve is not installed in this venv"
    assert installed[OURS] == {"loraserve"}, f"another distribution installs {OURS}: {installed[OURS]}"
    assert not collisions(REPO, installed), "\n".join(collisions(REPO, installed))


def test_the_lists_see_what_the_checkout_and_venv_hold(venv_names) -> None:
    """The two sides are real: the root's folders, pytest's test folders and the venv's names."""
    root = laid_out(REPO)
    assert {"loraserve", "tests", "bench", "scripts", "deploy", "docs"} <= set(root)
    assert root["loraserve"] == "package"
    assert {REPO / "tests", REPO / "tests" / "kernels", REPO / "tests" / "catalog"} <= pytest_roots(REPO / "tests")
    installed = venv_names
    assert {"torch", "transformers", "peft", "_pytest"} <= set(installed)
    assert installed["kernels"] == {"kernels"}  # transformers' dependency, once our folder's name
    reference = {n for n in importlib.metadata.packages_distributions() if n.isidentifier()}
    assert reference <= set(installed), reference - set(installed)  # the stdlib's view, at least


def _dummy_distribution(site: Path, name: str, *, namespace: bool = False) -> None:
    """A distribution installed into `site` the way pip lays one out: its package and dist-info."""
    pkg = site / name
    pkg.mkdir(parents=True)
    if not namespace:
        (pkg / "__init__.py").write_text("")
    info = site / f"dummy_{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(textwrap.dedent(f"""\
        Metadata-Version: 2.1
        Name: dummy-{name}
        Version: 1.0
        """))
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n")


@pytest.mark.parametrize("name", ["deploy", "scripts", "bench", "tests", "docs"])
def test_a_distribution_named_like_a_root_folder_is_caught(venv_names, tmp_path, name) -> None:
    _dummy_distribution(tmp_path, name)
    found = collisions(REPO, with_dummy(venv_names, tmp_path))
    assert found == [f"{name} (namespace) is also installed by dummy-{name}"]


def test_a_distribution_named_like_a_test_helper_is_caught(venv_names, tmp_path) -> None:
    """tests/s3_testing.py is importable under pytest: a distribution shipping a top-level
    `s3_testing` would be shadowed by it (or shadow it, in another order)."""
    _dummy_distribution(tmp_path, "s3_testing")
    assert collisions(REPO, with_dummy(venv_names, tmp_path)) == [
        "tests/s3_testing (module) is also installed by dummy-s3_testing"]


def test_a_second_loraserve_is_caught(venv_names, tmp_path) -> None:
    _dummy_distribution(tmp_path, OURS)
    assert collisions(REPO, with_dummy(venv_names, tmp_path)) == [
        "loraserve (package) is also installed by dummy-loraserve"]
