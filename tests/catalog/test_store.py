"""Catalog store: revisions, promote / rollback / tags, listing, stats, corruption, map growth."""
import json

import lmdb
import pytest
import torch

from loraserve.catalog.errors import (AdapterNotFound, BaseMismatch, CatalogError, CorruptBlob, InvalidAdapterId,
                            RevisionExists, RevisionNotFound)
from loraserve.catalog.layout import AdapterWeights, load_revision, save_revision
from loraserve.catalog.shards import MiB, ShardOptions, shard_of
from loraserve.catalog.store import Catalog


def blob(fp="fp-a", rank=2, seed=0, hidden=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(rank, hidden, generator=g).to(dtype),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(hidden, rank, generator=g).to(dtype)}
    return save_revision(AdapterWeights(fp, rank, ["q_proj"], dtype, t, "test"))


@pytest.fixture
def cat(tmp_path):
    with Catalog.create(tmp_path / "cat", shards=4) as c:
        yield c


def test_layout_round_trip_and_meta():
    b = blob(dtype=torch.bfloat16)
    w = load_revision(b)
    assert w.rank == 2 and w.targets == ["q_proj"] and w.dtype == torch.bfloat16 and w.base_fingerprint == "fp-a"
    assert w.nbytes == 2 * (2 * 8 * 2)
    assert w.meta["format"] == "loraserve.adapter.v1"


def test_layout_rejects_inconsistent_weights():
    with pytest.raises(ValueError, match="rank"):
        AdapterWeights("fp", 3, ["q_proj"], torch.float32,
                       {"layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 8),
                        "layers.0.self_attn.q_proj.lora_B": torch.zeros(8, 2)})
    with pytest.raises(ValueError, match="lora_B"):
        AdapterWeights("fp", 2, ["q_proj"], torch.float32, {"layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 8)})


def test_put_resolve_promote_rollback_tag(cat):
    r1 = cat.put_revision("acme/x", blob(seed=1))
    r2 = cat.put_revision("acme/x", blob(seed=2), promote=False)
    assert (r1.revision, r2.revision) == ("r1", "r2")
    assert cat.resolve("acme/x").revision == "r1"
    assert cat.resolve("acme/x", "r2").checksum == r2.checksum
    p = cat.promote("acme/x", "r2")
    assert (p.promoted, p.previous) == ("r2", "r1")
    p = cat.rollback("acme/x")
    assert (p.promoted, p.previous) == ("r1", "r2")
    cat.tag("acme/x", "canary", "r2")
    assert cat.resolve("acme/x", "canary").revision == "r2"
    assert cat.promote("acme/x", "canary").promoted == "r2"
    assert cat.put_revision("acme/x", blob(seed=3), revision="exp-1").revision == "exp-1"
    assert cat.put_revision("acme/x", blob(seed=4)).revision == "r3"
    assert cat.policy("acme/x").revisions == ["r1", "r2", "exp-1", "r3"]


def test_read_blob_is_verified_copy(cat):
    b = blob()
    rec = cat.put_revision("acme/x", b)
    assert cat.read_blob(rec) == b
    assert isinstance(cat.read_blob(rec), bytes)


def test_errors(cat):
    with pytest.raises(AdapterNotFound) as e:
        cat.policy("acme/none")
    assert e.value.status == 404
    cat.put_revision("acme/x", blob(), promote=False)
    with pytest.raises(RevisionNotFound):
        cat.resolve("acme/x")  # nothing promoted
    with pytest.raises(RevisionNotFound):
        cat.resolve("acme/x", "r9")
    with pytest.raises(RevisionNotFound):
        cat.rollback("acme/x")
    with pytest.raises(InvalidAdapterId):
        cat.policy("../../etc/passwd")
    with pytest.raises(InvalidAdapterId):
        cat.put_revision("acme/x", blob(), revision="../r1")
    with pytest.raises(BaseMismatch, match="fp-a.*fp-b"):
        cat.put_revision("acme/x", blob(fp="fp-b"))
    with pytest.raises(RevisionExists):
        cat.put_revision("acme/x", blob(seed=5), revision="r1")
    assert cat.put_revision("acme/x", blob(), revision="r1").revision == "r1"  # same bytes: idempotent
    with pytest.raises(CorruptBlob):
        cat.put_revision("acme/y", b"not a safetensors blob")


def test_corrupt_and_truncated_blobs_never_load(cat, tmp_path):
    rec = cat.put_revision("acme/x", blob())
    shard = cat.shard(cat.shard_index("acme/x"))
    key = rec.ref.encode()

    def overwrite(value):
        shard.write(lambda txn, dbs: txn.put(key, value, db=dbs.blob))

    good = cat.read_blob(rec)
    overwrite(good[:-1] + bytes([good[-1] ^ 0xFF]))
    with pytest.raises(CorruptBlob, match="acme/x@r1.*checksum"):
        cat.read_blob(rec)
    overwrite(good[: len(good) // 2])
    with pytest.raises(CorruptBlob, match="acme/x@r1.*truncated"):
        cat.read_blob(rec)


def test_list_by_prefix_and_paging(cat):
    ids = [f"t{t}/n{i:02d}" for t in range(2) for i in range(12)]
    for a in ids:
        cat.put_revision(a, blob())
    assert [p.adapter_id for p in cat.list("t1/", limit=100)] == sorted(a for a in ids if a.startswith("t1/"))
    page1 = cat.list("t0/", limit=5)
    page2 = cat.list("t0/", limit=5, after=page1[-1].adapter_id)
    assert [p.adapter_id for p in page1 + page2] == sorted(ids)[:10]
    assert cat.list("zz") == []


def test_stats_and_shard_routing(cat, tmp_path):
    for i in range(20):
        cat.put_revision(f"acme/a{i}", blob(seed=i))
    cat.put_revision("acme/a0", blob(seed=99))
    st = cat.stats()
    assert (st["adapters"], st["revisions"], st["shards"]) == (20, 21, 4)
    assert st["bytes"] == 21 * len(blob())
    for row in st["per_shard"]:
        expect = sum(1 for i in range(20) if shard_of(f"acme/a{i}", 4) == row["shard"])
        assert row["adapters"] == expect
    assert json.loads((tmp_path / "cat" / "catalog.json").read_text())["shards"] == 4


def test_create_is_idempotent_and_checks_shards(tmp_path):
    Catalog.create(tmp_path / "c", shards=3).close()
    assert Catalog.create(tmp_path / "c", shards=3).shards == 3
    with pytest.raises(CatalogError, match="3 shards"):
        Catalog.create(tmp_path / "c", shards=5)
    with pytest.raises(CatalogError, match="not a catalog"):
        Catalog.open(tmp_path / "nothing")


def test_readonly_catalog_refuses_writes_and_reads_missing_shards(tmp_path):
    Catalog.create(tmp_path / "c", shards=2).close()
    with Catalog.open(tmp_path / "c", readonly=True) as ro:
        with pytest.raises(AdapterNotFound):
            ro.policy("acme/x")
        with pytest.raises(CatalogError, match="read-only"):
            ro.put_revision("acme/x", blob())
        assert ro.stats()["adapters"] == 0


def test_full_map_grows_without_losing_anything(tmp_path):
    opts = ShardOptions(initial_map_size=1 * MiB, max_map_size=64 * MiB)
    with Catalog.create(tmp_path / "c", shards=1, options=opts) as cat:
        big = [blob(seed=i, hidden=256, rank=16) for i in range(60)]  # 32 KiB each, ~2 MiB in all
        recs = [cat.put_revision(f"acme/a{i}", b) for i, b in enumerate(big)]
        assert cat.shard(0).stats()["map_size"] > 1 * MiB
        assert [cat.read_blob(r) for r in recs] == big


def test_full_map_at_max_fails_clearly_and_keeps_data(tmp_path):
    opts = ShardOptions(initial_map_size=1 * MiB, max_map_size=1 * MiB)
    with Catalog.create(tmp_path / "c", shards=1, options=opts) as cat:
        first = cat.put_revision("acme/first", blob())
        with pytest.raises(CatalogError, match="map full"):
            for i in range(200):
                cat.put_revision(f"acme/a{i}", blob(seed=i, hidden=256, rank=8))
        assert cat.read_blob(first) == blob()
        n = cat.stats()["adapters"]
        assert n == len(cat.list(limit=1000)) and cat.stats()["revisions"] == n
    assert isinstance(lmdb.version(), tuple)
