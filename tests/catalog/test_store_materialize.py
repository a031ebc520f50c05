"""`catalog materialize --store`: the workers publish each batch as they commit it (a segment and
one conditional policy PUT an adapter), and a rerun publishes what an earlier run committed but
did not, never overwriting what the store holds."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraserve.catalog.materialize import MaterializeConfig, materialize
from loraserve.catalog.store import Catalog
from loraserve.catalog.store_materialize import MARKERS
from loraserve.catalog.store_s3 import ObjectStore, StoreTier

from s3_testing import moto_s3


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        server.client().create_bucket(Bucket="catalog")
        yield server


REPO = Path(__file__).resolve().parents[2]


def config(tmp_path, dense_base, count: int, store: str | None, **kw) -> MaterializeConfig:
    return MaterializeConfig(tmp_path / "built", dense_base, count, rank=2, workers=2, batch=4,
                             progress=False, store=store, **kw)


def faults_in_everywhere(store: ObjectStore, built, empty_dir, count: int) -> None:
    """Every adapter faults in from `store` into an empty host, with the checksum `built` has."""
    with Catalog.open(built) as cat, Catalog.create(empty_dir, shards=2) as empty:
        reader = StoreTier(store, empty)
        try:
            for i in range(count):
                adapter_id = f"synth/a{i:07d}"
                assert reader.fault_in(adapter_id).checksum == cat.resolve(adapter_id).checksum
        finally:
            reader.close()


def test_materialize_publishes_as_it_goes(s3, dense_base, tmp_path, capsys):
    from loraserve.cli_catalog import run
    uri = "s3://catalog/materialize-cli"
    assert run(["catalog", "materialize", str(tmp_path / "built"), "--model", str(dense_base), "--count", "18",
                "--shards", "4", "--workers", "2", "--batch", "4", "--no-progress", "--store", uri]) == 0
    assert "materialized 18 new" in (out := capsys.readouterr().out) and "published 18, already in the store 0" in out
    store = ObjectStore(uri)
    assert len(store.list_after("segments")) >= 5 and not store.list_after("blobs")  # a segment per batch
    faults_in_everywhere(store, tmp_path / "built", tmp_path / "empty", 18)


def test_a_rerun_publishes_what_was_committed_but_not_published(s3, dense_base, tmp_path):
    uri = "s3://catalog/materialize-resume"
    Catalog.create(tmp_path / "built", shards=4).close()
    first = materialize(config(tmp_path, dense_base, 12, None))  # committed, never published
    assert first.ok and (first.written, first.published) == (12, 0)
    again = materialize(config(tmp_path, dense_base, 20, uri))  # publishes the 12, builds and publishes 8
    assert again.ok and (again.written, again.skipped, again.published, again.already) == (8, 12, 20, 0)
    done = materialize(config(tmp_path, dense_base, 20, uri))
    assert (done.written, done.published, done.already) == (0, 0, 0)  # the markers say all is there
    store = ObjectStore(uri)
    with Catalog.open(tmp_path / "built") as cat:
        writer = StoreTier(store, cat)
        cat.tag("synth/a0000003", "stable", "r1")  # published: the store's policy changes
        writer.close()
        tagged = store.policy("synth/a0000003").tags
    shutil.rmtree(tmp_path / "built" / MARKERS)  # a lost marker: everything is published again ...
    lost = materialize(config(tmp_path, dense_base, 20, uri))
    assert (lost.published, lost.already) == (0, 20)  # ... as conditional creates: none overwritten
    assert store.policy("synth/a0000003").tags == tagged == {"stable": "r1"}
    faults_in_everywhere(store, tmp_path / "built", tmp_path / "empty", 20)


def reference(tmp_path, dense_base, count: int):
    """The same adapters built into a local catalog only: what the store must hold."""
    Catalog.create(tmp_path / "reference", shards=2).close()
    cfg = config(tmp_path, dense_base, count, None)
    cfg.catalog_dir = tmp_path / "reference"
    assert materialize(cfg).ok
    return tmp_path / "reference"


def local_adapters(catalog_dir) -> int:
    with Catalog.open(catalog_dir, readonly=True) as cat:
        return cat.stats()["adapters"]


def test_store_only_builds_into_the_store_and_keeps_nothing_locally(s3, dense_base, tmp_path):
    uri = "s3://catalog/materialize-store-only"
    Catalog.create(tmp_path / "built", shards=4).close()
    rep = materialize(config(tmp_path, dense_base, 18, uri, store_only=True))
    assert rep.ok and (rep.written, rep.published, rep.already) == (18, 18, 0)
    assert local_adapters(tmp_path / "built") == 0
    again = materialize(config(tmp_path, dense_base, 22, uri, store_only=True))  # the markers: only 4 more
    assert again.ok and (again.written, again.skipped, again.published) == (4, 18, 4)
    assert local_adapters(tmp_path / "built") == 0
    faults_in_everywhere(ObjectStore(uri), reference(tmp_path, dense_base, 22), tmp_path / "empty", 22)


def store_only_cmd(built, base, count: int, uri: str) -> list[str]:
    code = "import sys; from loraserve.cli_catalog import run; sys.exit(run(sys.argv[1:]))"
    return [sys.executable, "-c", code, "catalog", "materialize", str(built), "--model", str(base),
            "--count", str(count), "--workers", "2", "--batch", "4", "--shards", "4", "--rank", "2",
            "--no-progress", "--store", uri, "--store-only"]


def marked(built) -> int:
    """How many shards have a published marker yet."""
    return len(list((built / MARKERS).glob("shard-*.json"))) if (built / MARKERS).exists() else 0


def test_store_only_killed_midway_then_rerun_publishes_each_adapter_once(s3, dense_base, tmp_path):
    uri, n, built = "s3://catalog/materialize-store-only-kill", 500, tmp_path / "built"
    proc = subprocess.Popen(store_only_cmd(built, dense_base, n, uri), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300  # the CLI's imports are slow on a loaded machine
        while marked(built) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its workers, mid-publish
        proc.wait()
    store = ObjectStore(uri)
    before = len(store.list_after("policies"))
    assert 0 < before < n, "the kill was meant to land mid-run"
    done = subprocess.run(store_only_cmd(built, dense_base, n, uri), cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # the rerun skipped what the markers name and built the rest; what a batch published but not
    # yet marked held already is found there (conditional creates): never published twice
    out = done.stdout
    skipped = int(out.split(" new, ")[1].split(" already")[0])
    published = int(out.split("published ")[1].split(",")[0])
    already = int(out.split("already in the store ")[1].split()[0])
    assert skipped + published + already == n and skipped > 0 and published == n - before
    assert len(store.list_after("policies")) == n and local_adapters(built) == 0
    shards = {json.loads(p.read_text())["store"] for p in (built / MARKERS).glob("shard-*.json")}
    assert shards == {store.uri}
    ids = list(range(0, n, 23))
    ref = reference(tmp_path, dense_base, n)
    with Catalog.open(ref) as cat, Catalog.create(tmp_path / "empty", shards=2) as empty:
        reader = StoreTier(store, empty)
        try:
            for i in ids:
                one = f"synth/a{i:07d}"
                assert reader.fault_in(one).checksum == cat.resolve(one).checksum
        finally:
            reader.close()
