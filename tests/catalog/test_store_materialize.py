"""`catalog materialize --store`: the workers publish each batch as they commit it (a segment and
one conditional policy PUT an adapter), and a rerun publishes what an earlier run committed but
did not, never overwriting what the store holds."""
from __future__ import annotations

import shutil

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


def config(tmp_path, dense_base, count: int, store: str | None) -> MaterializeConfig:
    return MaterializeConfig(tmp_path / "built", dense_base, count, rank=2, workers=2, batch=4,
                             progress=False, store=store)


def faults_in_everywhere(store: ObjectStore, built, empty_dir, count: int) -> None:
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
