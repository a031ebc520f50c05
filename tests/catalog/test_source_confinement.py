"""Local sources are confined to the requesting tenant's subtree after links are resolved (issue
43: `acme/x -> ../beta/secret` served beta's adapter to acme's key). A property over generated
link layouts: links (relative or absolute, chained, to directories or into them) placed inside
and around tenants' subtrees; a fetch of `acme/<name>` either reads a directory that is
really inside acme's subtree or is refused (403/404), never anything of beta's or outside."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraserve.catalog.errors import CatalogError, SourceForbidden, SourceNotFound
from loraserve.catalog.sources import LocalFetcher, Template

TENANTS = ("acme", "beta")
NAMES = ("a", "b", "c", "d")
# where a link may point: inside acme, inside beta, the root, outside the root, itself a link
TARGETS = st.sampled_from(["acme/a", "acme/b", "acme/sub/deep", "beta/a", "beta/secret", ".",
                           "..", "outside", "acme", "beta", "acme/c", "beta/c"])


def _layout(root: Path, links: list[tuple[str, str, str, bool]]) -> None:
    """Real adapter dirs for both tenants and `outside`, then the links: (tenant, name, target,
    absolute)."""
    for tenant in TENANTS:
        for name in ("a", "b", "secret"):
            d = root / "src" / tenant / name
            d.mkdir(parents=True, exist_ok=True)
            (d / "adapter_config.json").write_text(f'{{"owner": "{tenant}/{name}"}}')
        (root / "src" / tenant / "sub" / "deep").mkdir(parents=True, exist_ok=True)
        (root / "src" / tenant / "sub" / "deep" / "adapter_config.json").write_text(
            f'{{"owner": "{tenant}/sub"}}')
    (root / "outside").mkdir(exist_ok=True)
    (root / "outside" / "adapter_config.json").write_text('{"owner": "outside"}')
    for tenant, name, target, absolute in links:
        link = root / "src" / tenant / name
        if link.exists() or link.is_symlink():
            continue
        dest = (root / target) if target == "outside" else (root / "src" / target)
        link.symlink_to(dest if absolute else Path(os.path.relpath(dest, link.parent)))


def _owner(source) -> str:
    return source.read("adapter_config.json").decode()


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(links=st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(NAMES), TARGETS,
                                st.booleans()), max_size=6),
       asked=st.sampled_from(NAMES + ("a",)))
def test_acme_reads_only_its_own_subtree(links, asked) -> None:
    root = Path(tempfile.mkdtemp(prefix="confine-"))
    try:
        _layout(root, links)
        template = Template(f"{root}/src/{{tenant}}/{{name}}")
        fetcher = LocalFetcher(template)
        location = template.fill(f"acme/{asked}")
        acme_real = os.path.realpath(root / "src" / "acme")
        try:
            source = fetcher.open(location, root, 1 << 20)
        except (SourceForbidden, SourceNotFound):
            return
        except CatalogError as exc:  # a 400 (not a directory, ...): refused too
            assert exc.status < 500
            return
        # served: the directory really is inside acme's subtree, and so is what is read
        assert os.path.commonpath([source.dir, acme_real]) == acme_real, (links, asked)
        try:
            owner = _owner(source)
        except (SourceForbidden, FileNotFoundError):
            return
        assert '"acme/' in owner, (links, asked, owner)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_reported_attack_is_refused(tmp_path: Path) -> None:
    _layout(tmp_path, [("acme", "x", "beta/secret", False)])
    template = Template(f"{tmp_path}/src/{{tenant}}/{{name}}")
    with pytest.raises(SourceForbidden) as err:
        LocalFetcher(template).open(template.fill("acme/x"), tmp_path, 1 << 20)
    assert str(tmp_path) not in str(err.value) and "beta" not in str(err.value)


def test_a_tenant_dir_that_is_a_link_is_refused(tmp_path: Path) -> None:
    _layout(tmp_path, [])
    shutil.rmtree(tmp_path / "src" / "acme")
    (tmp_path / "src" / "acme").symlink_to("beta")  # acme's whole subtree is beta's
    template = Template(f"{tmp_path}/src/{{tenant}}/{{name}}")
    with pytest.raises(SourceForbidden):
        LocalFetcher(template).open(template.fill("acme/secret"), tmp_path, 1 << 20)


def test_a_linked_source_root_is_the_operators_and_allowed(tmp_path: Path) -> None:
    _layout(tmp_path, [])
    (tmp_path / "linked").symlink_to(tmp_path / "src")
    template = Template(f"{tmp_path}/linked/{{tenant}}/{{name}}")
    source = LocalFetcher(template).open(template.fill("acme/a"), tmp_path, 1 << 20)
    assert '"acme/a"' in _owner(source)
