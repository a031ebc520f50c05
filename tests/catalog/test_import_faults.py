"""Adapter imports are confined, never block, are bounded, and let nothing malformed or non-finite in.

Each refused input gets a clear error (the status the server answers with, a message naming
the file/field/tensor), leaves the catalog as it was, and a good import still works after it.
"""
import json
import math
import os
import threading
import time

import pytest

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import (ExportError, NonFiniteWeights, SourceForbidden, SourceNotFound,
                                      SourceTooLarge)
from loraserve.catalog.export import export_peft
from loraserve.catalog.importer import adapter_blob, import_peft
from loraserve.catalog.layout import load_revision, save_revision
from loraserve.catalog.source import AdapterSource
from loraserve.catalog.store import Catalog
from loraserve.cli_catalog import run

from server.adapter_files import poison, write_peft


@pytest.fixture(scope="module")
def base(dense_base):
    return BaseInfo.from_dir(dense_base)


@pytest.fixture
def root(tmp_path, dense_base):
    """An adapter root holding one good PEFT dir `good`; a catalog beside it (not inside)."""
    r = tmp_path / "root"
    write_peft(r / "good", dense_base)
    Catalog.create(tmp_path / "cat", shards=2).close()
    return r


def snapshot(cat_dir) -> list:
    with Catalog.open(cat_dir, readonly=True) as cat:
        return [p.to_dict() for p in cat.list(limit=1000)]


def good_import(cat_dir, root, base, name="acme/ok") -> None:
    with Catalog.open(cat_dir) as cat:
        rec = import_peft(cat, name, AdapterSource("good", root=root), base.model_dir, base=base)
        assert load_revision(cat.read_blob(rec)).rank == 4


# -- confinement -----------------------------------------------------------------------------
def test_links_leaving_the_root_are_403_with_one_message(root, tmp_path, base):
    (tmp_path / "outside").mkdir()
    write_peft(tmp_path / "outside" / "peft", base.model_dir)
    os.symlink(tmp_path / "outside" / "peft", root / "to-outside")
    os.symlink("/etc/passwd", root / "to-passwd")
    os.symlink("/nonexistent/secret", root / "to-nothing")
    leak = root / "leaky"
    write_peft(leak, base.model_dir)
    os.remove(leak / "adapter_config.json")
    os.symlink("/etc/passwd", leak / "adapter_config.json")
    messages = {}
    for path in ("to-outside", "to-passwd", "to-nothing", "../outside/peft", str(tmp_path / "outside" / "peft")):
        with pytest.raises(SourceForbidden) as e:
            AdapterSource(path, root=root)
        assert e.value.status == 403
        messages[path] = str(e.value).replace(repr(path), "PATH")
    assert len(set(messages.values())) == 1  # whether the target exists or not: the same words
    assert "passwd" not in messages["to-passwd"] and "secret" not in messages["to-nothing"]
    with pytest.raises(SourceForbidden, match="leaky/adapter_config.json") as e:
        export_peft(AdapterSource("leaky", root=root), base)
    assert "passwd" not in str(e.value)


def test_links_inside_the_root_are_followed(root, base):
    os.symlink(root / "good", root / "alias")
    (root / "linked").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.symlink(root / "good" / name, root / "linked" / name)  # e.g. a Hugging Face cache snapshot
    assert export_peft(AdapterSource("alias", root=root), base).rank == 4
    assert export_peft(AdapterSource("linked", root=root), base).rank == 4


def test_unconfined_paths_are_relative_to_the_working_directory(root, base, monkeypatch):
    monkeypatch.chdir(root)
    assert export_peft("good", base).rank == 4  # the command line: `loraserve export good ...`
    assert AdapterSource("good").dir == str((root / "good").resolve())


def test_missing_not_a_dir_nul_surrogate(root, base):
    with pytest.raises(SourceNotFound) as e:
        AdapterSource("nope", root=root)
    assert e.value.status == 404
    with pytest.raises(ExportError, match="not a directory") as e:
        AdapterSource("good/adapter_config.json", root=root)
    assert e.value.status == 400
    for bad, what in (("go\0od", "NUL"), ("good\ud800", "unencodable")):
        with pytest.raises(ExportError, match=what) as e:
            AdapterSource(bad, root=root)
        assert e.value.status == 400


def test_fifo_and_device_files_are_400_at_once(root, base):
    fifo_dir = root / "fifo"
    write_peft(fifo_dir, base.model_dir)
    os.remove(fifo_dir / "adapter_config.json")
    os.mkfifo(fifo_dir / "adapter_config.json")  # no writer: a blocking read would wait forever
    dev_dir = root / "dev"
    write_peft(dev_dir, base.model_dir)
    os.remove(dev_dir / "adapter_model.safetensors")
    os.symlink("/dev/zero", dev_dir / "adapter_model.safetensors")  # outside the root: refused first
    done: list = []

    def attempt():
        try:
            export_peft(AdapterSource("fifo", root=root), base)
        except ExportError as e:
            done.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5
    assert "adapter_config.json: not a regular file" in str(done[0]) and done[0].status == 400
    with pytest.raises(SourceForbidden):
        export_peft(AdapterSource("dev", root=root), base)


def test_size_cap_is_413(root, base):
    size = sum(f.stat().st_size for f in (root / "good").iterdir())
    with pytest.raises(SourceTooLarge, match="import limit") as e:
        export_peft(AdapterSource("good", root=root, max_bytes=size - 1), base)
    assert e.value.status == 413
    assert export_peft(AdapterSource("good", root=root, max_bytes=size), base).rank == 4
    huge = root / "huge-config"
    write_peft(huge, base.model_dir)
    (huge / "adapter_config.json").write_text(json.dumps({"r": 4, "pad": "x" * (2 << 20)}))
    with pytest.raises(SourceTooLarge, match="adapter_config.json"):
        export_peft(AdapterSource("huge-config", root=root), base)


# -- adapter_config.json -----------------------------------------------------------------------
BAD_CONFIGS = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply|not valid JSON"),
    (json.dumps({"lora_alpha": 8}).encode(), "field 'r'.*missing"),
    (json.dumps({"r": "8"}).encode(), "field 'r' must be an integer"),
    (json.dumps({"r": 0}).encode(), "field 'r' must be an integer >= 1"),
    (json.dumps({"r": True}).encode(), "field 'r'"),
    (json.dumps({"r": 4, "lora_alpha": "8"}).encode(), "field 'lora_alpha' must be a finite number"),
    (b'{"r": 4, "lora_alpha": NaN}', "field 'lora_alpha' must be a finite number"),
    (json.dumps({"r": 4, "use_rslora": "yes"}).encode(), "field 'use_rslora' must be true or false"),
    (json.dumps({"r": 4, "rank_pattern": [1]}).encode(), "field 'rank_pattern' must be an object"),
    (json.dumps({"r": 4, "rank_pattern": {"q_proj": "2"}}).encode(), "field 'rank_pattern.q_proj' must be an integer"),
    (json.dumps({"r": 4, "alpha_pattern": {"q_proj": None}}).encode(), "field 'alpha_pattern.q_proj'"),
    (json.dumps({"r": 4, "rank_pattern": {"(a+)+$": 2}}).encode(), "not a supported module pattern"),
    (json.dumps({"r": 4, "rank_pattern": {"q_proj[": 2}}).encode(), "not a supported module pattern"),
    (json.dumps({"r": 4, "peft_type": "IA3"}).encode(), "peft_type 'IA3' is not LORA"),
]


@pytest.mark.parametrize("raw, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_malformed_config_is_400_naming_the_field_and_writes_nothing(root, tmp_path, base, raw, message):
    write_peft(root / "bad", base.model_dir)
    (root / "bad" / "adapter_config.json").write_bytes(raw)
    before = snapshot(tmp_path / "cat")
    with Catalog.open(tmp_path / "cat") as cat:
        with pytest.raises(ExportError, match=message) as e:
            import_peft(cat, "acme/bad", AdapterSource("bad", root=root), base.model_dir, base=base)
    assert e.value.status == 400 and "adapter_config.json" in str(e.value)
    assert snapshot(tmp_path / "cat") == before
    good_import(tmp_path / "cat", root, base)


def test_pattern_keys_peft_uses_still_work(root, base):
    cfg = {"r": 4, "lora_alpha": 8, "rank_pattern": {"^model.layers.0.self_attn.q_proj": 4},
           "alpha_pattern": {"layers\\.[01]\\.self_attn\\.v_proj": 16, ".*q_proj": 8}}
    write_peft(root / "patterns", base.model_dir, config=cfg)
    assert export_peft(AdapterSource("patterns", root=root), base).rank == 4


# -- admission before any write ----------------------------------------------------------------
def test_refused_admission_writes_nothing(root, tmp_path, base):
    good_import(tmp_path / "cat", root, base, "acme/x")
    before = snapshot(tmp_path / "cat")

    def refuse(rank, targets):
        assert (rank, targets) == (4, ["q_proj", "v_proj"])
        raise ValueError("rank above this server's limit")

    with Catalog.open(tmp_path / "cat") as cat:
        with pytest.raises(ValueError, match="limit"):
            import_peft(cat, "acme/x", AdapterSource("good", root=root), base.model_dir, base=base, admit=refuse)
        with pytest.raises(ValueError):
            import_peft(cat, "acme/y", AdapterSource("good", root=root), base.model_dir, base=base, admit=refuse)
    assert snapshot(tmp_path / "cat") == before


# -- non-finite weights --------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_peft_tensor_is_400_naming_it(root, base, value):
    write_peft(root / "nan", base.model_dir)
    name = poison(root / "nan", value)
    with pytest.raises(NonFiniteWeights, match=name.replace(".", r"\.")) as e:
        export_peft(AdapterSource("nan", root=root), base)
    assert e.value.status == 400 and isinstance(e.value, ExportError)


def test_scaling_overflow_is_non_finite_too(root, base):
    write_peft(root / "big", base.model_dir, alpha=4e40)  # alpha/r = 1e40: B * 1e40 overflows float32
    with pytest.raises(NonFiniteWeights, match=r"lora_B.*after scaling"):
        export_peft(AdapterSource("big", root=root), base)


def test_non_finite_is_refused_by_export_and_catalog_import_clis(root, tmp_path, base, capsys):
    write_peft(root / "nan", base.model_dir)
    name = poison(root / "nan", math.nan)
    cat = str(tmp_path / "cat")
    before = snapshot(cat)
    out = tmp_path / "nan.safetensors"
    for argv in (["export", str(root / "nan"), "--model", str(base.model_dir), "--out", str(out)],
                 ["catalog", "import", cat, "acme/nan", str(root / "nan"), "--model", str(base.model_dir)]):
        assert run(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and name in err and "NaN" in err, err
    assert not out.exists()
    # an exported blob holding Inf (written by something other than `loraserve export`)
    weights = export_peft(AdapterSource("good", root=root), base)
    bad_name = sorted(weights.tensors)[0]
    weights.tensors[bad_name][0, 0] = math.inf
    out.write_bytes(save_revision(weights, check=False))
    with pytest.raises(NonFiniteWeights, match=bad_name):
        adapter_blob(out, base)
    assert run(["catalog", "import", cat, "acme/inf", str(out), "--model", str(base.model_dir)]) == 1
    assert bad_name in capsys.readouterr().err
    assert snapshot(cat) == before
    good_import(tmp_path / "cat", root, base)
