"""A host's catalog copy kept in step with the writer's while a reader has it open: new and
promoted revisions appear in the reader's next read, unchanged shards are skipped, snapshots
carry a consistent per-shard copy between hosts."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from loraserve.catalog.store import Catalog
from loraserve.catalog.sync import main, snapshot_catalog, sync_catalog
from loraserve.cli import main as catalog_cli
from loraserve.demo import DemoPaths, build_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    """The run's shared demo (built once under a lock, as tests/test_demo.py does)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    with open(base / "loraserve-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_demo(base / "loraserve-demo")


def _import(catalog, demo: DemoPaths, adapter_id: str, weights: str, *extra: str) -> None:
    assert catalog_cli(["catalog", "import", str(catalog), adapter_id, str(demo.adapters[weights]),
                        "--model", str(demo.qwen3), *extra]) == 0


def _apply_elsewhere(src, dst) -> str:
    """The sync in its own process (as on a host: engines read, a sync agent writes)."""
    out = subprocess.run([sys.executable, "-m", "loraserve.catalog.sync", "apply", str(src), str(dst)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_reader_sees_synced_revisions_without_reopening(demo, tmp_path) -> None:
    writer = tmp_path / "writer"
    shutil.copytree(demo.catalog, writer)
    first = sync_catalog(writer, tmp_path / "copy")
    assert first.shards_changed and first.blobs_copied == 3
    with Catalog.open(tmp_path / "copy", readonly=True) as reader:
        assert reader.policy("demo/pirate").promoted == "r1"
        _import(writer, demo, "demo/pirate", "demo/robot", "--revision", "r2")  # promoted
        _import(writer, demo, "demo/new", "demo/poet")
        assert "blobs copied: 2 " in _apply_elsewhere(writer, tmp_path / "copy")
        assert reader.policy("demo/pirate").promoted == "r2"
        rec = reader.resolve("demo/new")
        with Catalog.open(writer, readonly=True) as w:
            assert reader.read_blob(rec) == w.read_blob(w.resolve("demo/new"))
        assert not reader.degraded(max_age=0)
    again = sync_catalog(writer, tmp_path / "copy")
    assert again.shards_changed == [] and again.blobs_copied == 0


def test_rollback_and_snapshots_travel(demo, tmp_path, capsys) -> None:
    writer, stage, live = tmp_path / "writer", tmp_path / "stage", tmp_path / "live"
    shutil.copytree(demo.catalog, writer)
    assert main(["snapshot", str(writer), str(stage)]) == 0
    assert main(["apply", str(stage), str(live)]) == 0
    assert "blobs copied: 3" in capsys.readouterr().out
    _import(writer, demo, "demo/poet", "demo/pirate", "--revision", "r2")
    assert catalog_cli(["catalog", "rollback", str(writer), "demo/poet"]) == 0
    copied = snapshot_catalog(writer, stage)
    assert len(copied) == 1 and snapshot_catalog(writer, stage) == []
    report = sync_catalog(stage, live)
    assert report.shards_changed == copied and report.blobs_copied == 1
    with Catalog.open(live, readonly=True) as cat, Catalog.open(writer, readonly=True) as w:
        assert cat.policy("demo/poet") == w.policy("demo/poet")
        assert cat.policy("demo/poet").promoted == "r1"
