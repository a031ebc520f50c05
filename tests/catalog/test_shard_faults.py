"""A damaged or missing shard file is that shard's problem: ShardUnavailable (503) for its adapters,
the other shards serve on, listings refuse to answer partially, and nothing reads a page that is
not on disk (which would be SIGBUS, the end of the process, not an exception)."""
import os
import shutil

import pytest
import torch

from loraserve.catalog.errors import AdapterNotFound, CatalogError, ShardUnavailable
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.shardfile import unopened_fault
from loraserve.catalog.store import Catalog

from server.adapter_files import restore, truncate

SHARDS = 3


def blob(seed: int, hidden: int = 256, rank: int = 8) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(rank, hidden, generator=g),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(hidden, rank, generator=g)}
    return save_revision(AdapterWeights("fp", rank, ["q_proj"], torch.float32, t, "test"))


@pytest.fixture
def filled(tmp_path):
    """A catalog with 8 adapters in each of its shards; (dir, {shard: [ids]}, {id: blob})."""
    cat_dir = tmp_path / "cat"
    by_shard: dict[int, list[str]] = {s: [] for s in range(SHARDS)}
    blobs = {}
    with Catalog.create(cat_dir, shards=SHARDS) as cat:
        i = 0
        while min(len(v) for v in by_shard.values()) < 8:
            aid = f"acme/a{i}"
            s = cat.shard_index(aid)
            if len(by_shard[s]) < 8:
                blobs[aid] = blob(i)
                cat.put_revision(aid, blobs[aid])
                by_shard[s].append(aid)
            i += 1
    return cat_dir, by_shard, blobs


def data_file(cat_dir, shard: int):
    return cat_dir / f"shard-{shard:03d}" / "data.mdb"


def serves(cat: Catalog, aid: str, blobs: dict) -> bool:
    return cat.read_blob(cat.resolve(aid)) == blobs[aid]


def test_shard_truncated_while_open_fails_alone_then_recovers(filled):
    cat_dir, by_shard, blobs = filled
    with Catalog.open(cat_dir) as cat:
        assert all(serves(cat, a, blobs) for ids in by_shard.values() for a in ids)  # every env mapped
        assert cat.degraded_shards(max_age=0) == []
        old = truncate(data_file(cat_dir, 1), 8192)  # the two meta pages survive, the tree does not
        for aid in by_shard[1]:
            with pytest.raises(ShardUnavailable, match="shard 1 .*truncated") as e:
                cat.resolve(aid)
            assert e.value.status == 503 and e.value.code == "catalog_unavailable" and e.value.shards == [1]
        with pytest.raises(ShardUnavailable):
            cat.put_revision(by_shard[1][0], blobs[by_shard[1][0]], revision="again")
        assert all(serves(cat, a, blobs) for s in (0, 2) for a in by_shard[s])
        with pytest.raises(ShardUnavailable, match="listing needs every shard; unavailable: 1") as e:
            cat.list(limit=1000)
        assert e.value.shards == [1]
        with pytest.raises(ShardUnavailable):
            cat.stats()
        assert cat.degraded_shards() == [1] and "truncated" in cat.degraded()[1]
        restore(data_file(cat_dir, 1), old)  # same inode, same bytes: the shard serves again
        assert cat.degraded_shards(max_age=0) == []
        assert all(serves(cat, a, blobs) for a in by_shard[1])
        assert len(cat.list(limit=1000)) == 8 * SHARDS


@pytest.mark.parametrize("size", [100, 4096, 8192, 20000])
def test_damaged_shard_is_refused_before_lmdb_maps_it(filled, size):
    cat_dir, by_shard, blobs = filled
    truncate(data_file(cat_dir, 2), size)
    assert unopened_fault(data_file(cat_dir, 2)) is not None
    for readonly in (True, False):
        with Catalog.open(cat_dir, readonly=readonly) as cat:
            assert cat.degraded_shards() == [2]  # found by the pread of the meta pages alone
            with pytest.raises(ShardUnavailable, match="shard 2"):
                cat.policy(by_shard[2][0])
            if not readonly:  # a write must not re-create a damaged (e.g. empty) file either
                with pytest.raises(ShardUnavailable):
                    cat.put_revision(by_shard[2][0], blobs[by_shard[2][0]])
            assert serves(cat, by_shard[0][0], blobs)
    assert data_file(cat_dir, 2).stat().st_size == size  # never rewritten


def test_zero_length_file_is_a_shard_never_initialized(filled):
    """What a process killed while LMDB creates the shard leaves: LMDB's "new environment". It reads
    as empty and the next write initializes it (a rerun of `materialize` finishes). Once open,
    a shard cut to zero is truncated like any other (the test above)."""
    cat_dir, by_shard, blobs = filled
    truncate(data_file(cat_dir, 2), 0)
    with Catalog.open(cat_dir, readonly=True) as ro:
        assert ro.degraded_shards() == [] and ro.stats()["adapters"] == 16
        with pytest.raises(AdapterNotFound):
            ro.policy(by_shard[2][0])
    with Catalog.open(cat_dir) as cat:
        cat.put_revision(by_shard[2][0], blobs[by_shard[2][0]])
        assert serves(cat, by_shard[2][0], blobs) and cat.degraded_shards(max_age=0) == []
        truncate(data_file(cat_dir, 2), 0)
        with pytest.raises(ShardUnavailable, match="truncated"):
            cat.policy(by_shard[2][0])


def test_read_only_open_before_the_first_commit_is_empty(tmp_path):
    """A reader (another process, read-only) may open a shard its creator has initialized but not
    yet committed to: no named dbs yet. That shard is empty for now, then serves once written."""
    import lmdb

    Catalog.create(tmp_path / "cat", shards=1).close()
    lmdb.open(str(tmp_path / "cat" / "shard-000"), max_dbs=4).close()  # initialized, nothing committed
    with Catalog.open(tmp_path / "cat", readonly=True) as ro:
        assert ro.stats()["adapters"] == 0 and ro.list() == []
        with Catalog.open(tmp_path / "cat") as rw:
            rw.put_revision("acme/x", blob(1))
        assert [p.adapter_id for p in ro.list()] == ["acme/x"]


def test_catalog_dir_removed_under_open_catalog(filled, tmp_path):
    cat_dir, by_shard, blobs = filled
    with Catalog.open(cat_dir) as cat:
        assert serves(cat, by_shard[0][0], blobs)  # shard 0 open, the others not yet
        shutil.rmtree(cat_dir)
        for s in range(SHARDS):  # open or not: 503, never "not found"
            with pytest.raises(ShardUnavailable, match="catalog.json is missing"):
                cat.resolve(by_shard[s][0])
        with pytest.raises(ShardUnavailable):
            cat.put_revision("acme/new", blobs[by_shard[0][0]])
        with pytest.raises(ShardUnavailable):
            cat.list()
        assert cat.degraded_shards(max_age=0) == list(range(SHARDS))
    assert not cat_dir.exists()  # nothing re-created the directory


def test_data_file_removed_or_replaced_while_open(filled):
    cat_dir, by_shard, blobs = filled
    with Catalog.open(cat_dir) as cat:
        assert serves(cat, by_shard[0][0], blobs) and serves(cat, by_shard[1][0], blobs)
        os.remove(data_file(cat_dir, 0))
        copy = data_file(cat_dir, 1).with_suffix(".copy")
        shutil.copy(data_file(cat_dir, 1), copy)
        os.replace(copy, data_file(cat_dir, 1))  # same bytes, another inode than the one mapped
        with pytest.raises(ShardUnavailable, match="removed"):
            cat.resolve(by_shard[0][0])
        with pytest.raises(ShardUnavailable, match="replaced"):
            cat.resolve(by_shard[1][0])
        assert serves(cat, by_shard[2][0], blobs)
        assert cat.degraded_shards(max_age=0) == [0, 1]


def test_degraded_shards_rechecks_at_most_every_max_age(filled):
    cat_dir, by_shard, _ = filled
    with Catalog.open(cat_dir, readonly=True) as cat:
        assert cat.degraded_shards(max_age=0) == []
        truncate(data_file(cat_dir, 0), 8192)
        assert cat.degraded_shards(max_age=3600) == []  # the remembered verdicts, no recheck
        assert cat.degraded_shards(max_age=0) == [0]  # rechecked (meta pages by pread only)
        with pytest.raises(ShardUnavailable):
            cat.policy(by_shard[0][0])


def test_shard_unavailable_is_a_catalog_error_with_503():
    err = ShardUnavailable("x", [3])
    assert isinstance(err, CatalogError) and err.status == 503 and err.shards == [3]
