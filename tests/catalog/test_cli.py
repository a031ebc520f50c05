"""`loraserve export` / `loraserve catalog ...` command lines: output, exit codes, one-line errors."""
import json

from loraserve.catalog.layout import load_revision
from catalog_fixtures import make_peft
from loraserve.cli_catalog import run


def test_catalog_cli_round_trip(dense_base, tmp_path, capsys):
    peft_dir, _ = make_peft(dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    cat = str(tmp_path / "cat")
    assert run(["catalog", "init", cat, "--shards", "3"]) == 0
    assert run(["catalog", "import", cat, "acme/a", str(peft_dir), "--model", str(dense_base)]) == 0
    assert run(["catalog", "import", cat, "acme/a", str(peft_dir), "--model", str(dense_base), "--no-promote"]) == 0
    out = tmp_path / "a.safetensors"
    assert run(["export", str(peft_dir), "--model", str(dense_base), "--out", str(out)]) == 0
    assert load_revision(out.read_bytes()).targets == ["q_proj", "v_proj"]
    assert run(["catalog", "import", cat, "acme/b", str(out), "--model", str(dense_base), "--revision", "v1"]) == 0
    capsys.readouterr()

    assert run(["catalog", "stats", cat, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert {k: stats[k] for k in ("adapters", "revisions", "shards")} == {"adapters": 2, "revisions": 3, "shards": 3}
    assert stats["bytes"] > 0

    assert run(["catalog", "promote", cat, "acme/a", "r2"]) == 0
    assert "promoted=r2 previous=r1" in capsys.readouterr().out
    assert run(["catalog", "rollback", cat, "acme/a"]) == 0
    assert "promoted=r1 previous=r2" in capsys.readouterr().out
    assert run(["catalog", "tag", cat, "acme/a", "stable", "r2"]) == 0
    capsys.readouterr()
    assert run(["catalog", "show", cat, "acme/a@stable"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"]["revisions"] == ["r1", "r2"] and shown["revision"]["revision"] == "r2"
    assert run(["catalog", "list", cat, "--prefix", "acme/"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("\t")[0] for ln in lines] == ["acme/a", "acme/b"]


def test_cli_errors_are_one_line_and_nonzero(dense_base, other_dense_base, tmp_path, capsys):
    cat = str(tmp_path / "cat")
    peft_dir, _ = make_peft(other_dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=2, target_modules=["q_proj"])
    assert run(["catalog", "init", cat, "--shards", "2"]) == 0
    capsys.readouterr()
    cases = [
        (["catalog", "show", cat, "../../etc/passwd"], "invalid"),
        (["catalog", "show", cat, "acme/missing"], "not found"),
        (["catalog", "rollback", cat, "acme/missing"], "not found"),
        (["catalog", "stats", str(tmp_path / "nope"), "--json"], "not a catalog"),
    ]
    cases.append((["catalog", "import", cat, "acme/x", str(peft_dir), "--model", str(dense_base)], "another base"))
    for argv, needle in cases:
        assert run(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, (argv, err)
    assert not (tmp_path / "etc").exists()
