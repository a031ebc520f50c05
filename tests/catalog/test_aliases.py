"""Catalog aliases: a URI (MinT's `tinker://<run-id>/sampler_weights/<ckpt>`) naming one revision,
recorded by `loraserve catalog import --alias`, and looked up by the server."""
import pytest

from catalog_fixtures import make_peft
from loraserve.catalog.aliases import (AliasConflict, InvalidAlias, check_alias_free,
                                       lookup_alias, record_alias)
from loraserve.catalog.errors import AdapterNotFound, RevisionNotFound
from loraserve.catalog.store import Catalog
from loraserve.cli_catalog import run

ALIAS = "tinker://0034d8c9-0a88-52a9:train:0/sampler_weights/000080"


@pytest.fixture
def catalog(dense_base, tmp_path):
    peft_dir, _ = make_peft(dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=4,
                            target_modules=["q_proj"])
    with Catalog.create(tmp_path / "cat", shards=3) as cat:
        from loraserve.catalog.importer import import_peft
        import_peft(cat, "acme/a", peft_dir, dense_base)
        import_peft(cat, "acme/a", peft_dir, dense_base, revision="v2", promote=False)
        cat.tag("acme/a", "stable", "v2")
        yield cat


def test_record_and_look_up(catalog: Catalog) -> None:
    assert lookup_alias(catalog, ALIAS) is None
    assert record_alias(catalog, ALIAS, "acme/a", "stable") == "acme/a@v2"  # a tag: its revision
    assert lookup_alias(catalog, ALIAS) == "acme/a@v2"
    assert record_alias(catalog, ALIAS, "acme/a", "v2") == "acme/a@v2"  # again: a no-op
    assert lookup_alias(catalog, ALIAS + "x") is None
    assert lookup_alias(catalog, "acme/a") is None  # not a URI: never looked up


def test_an_alias_names_one_revision_for_good(catalog: Catalog) -> None:
    record_alias(catalog, ALIAS, "acme/a", "r1")
    with pytest.raises(AliasConflict, match="acme/a@r1"):
        record_alias(catalog, ALIAS, "acme/a", "v2")
    with pytest.raises(AliasConflict):
        check_alias_free(catalog, ALIAS, "acme/b")
    check_alias_free(catalog, ALIAS, "acme/a")  # the same adapter: checked when recorded


@pytest.mark.parametrize("alias", ["acme/a", "tinker://", "tinker://a b", "x" * 600,
                                   "tinker://a\n"])
def test_invalid_aliases(catalog: Catalog, alias: str) -> None:
    with pytest.raises(InvalidAlias):
        record_alias(catalog, alias, "acme/a", "r1")


def test_the_revision_must_exist(catalog: Catalog) -> None:
    with pytest.raises(RevisionNotFound):
        record_alias(catalog, ALIAS, "acme/a", "r9")
    with pytest.raises(AdapterNotFound):
        record_alias(catalog, ALIAS, "acme/zz", "r1")


def test_cli_import_records_aliases(dense_base, tmp_path, capsys) -> None:
    peft_dir, _ = make_peft(dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=4,
                            target_modules=["q_proj"])
    cat = str(tmp_path / "cat")
    assert run(["catalog", "init", cat, "--shards", "3"]) == 0
    assert run(["catalog", "import", cat, "acme/a", str(peft_dir), "--model", str(dense_base),
                "--alias", ALIAS]) == 0
    assert f"alias {ALIAS} -> acme/a@r1" in capsys.readouterr().out
    assert run(["catalog", "import", cat, "acme/b", str(peft_dir), "--model", str(dense_base),
                "--alias", ALIAS]) == 1  # taken by acme/a: nothing imported
    assert "already names acme/a@r1" in capsys.readouterr().err
    with Catalog(cat) as opened:
        assert lookup_alias(opened, ALIAS) == "acme/a@r1"
        with pytest.raises(AdapterNotFound):
            opened.policy("acme/b")
