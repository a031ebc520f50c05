"""Audit: covers every shard, passes on good adapters, catches planted corruption and wrong-base revisions."""
import pytest

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.importer import import_peft
from loraserve.catalog.materialize import MaterializeConfig, materialize
from loraserve.catalog.store import Catalog
from loraserve.catalog.synth import build_template, target_modules
from catalog_fixtures import make_peft
from loraserve.audit import run_audit, sample_ids
from loraserve.cli_catalog import run


@pytest.fixture
def audited_catalog(dense_base, tmp_path):
    cat_dir = tmp_path / "cat"
    Catalog.create(cat_dir, shards=5).close()
    rep = materialize(MaterializeConfig(cat_dir, dense_base, 40, rank=2, targets=["q_proj", "v_proj", "down_proj"],
                                        workers=2, progress=False))
    assert rep.ok
    peft_dir, _ = make_peft(dense_base, tmp_path / "peft", "qwen3", r=4, lora_alpha=8,
                            target_modules=["q_proj", "o_proj", "up_proj", "lm_head"])
    with Catalog.open(cat_dir) as cat:
        import_peft(cat, "acme/trained", peft_dir, dense_base)
    return cat_dir


def test_audit_passes_and_covers_every_shard(audited_catalog, dense_base, capsys):
    rep = run_audit(audited_catalog, dense_base, sample=12)
    assert rep.ok, rep.failures
    assert (rep.shards, rep.shards_covered, rep.audited) == (5, 5, 12)
    assert 0 < rep.max_error < 1e-5
    assert run(["catalog", "audit", str(audited_catalog), "--model", str(dense_base), "--sample", "41"]) == 0
    out = capsys.readouterr().out
    assert "shards covered: 5/5" in out and "adapters audited: 41" in out and "failures: 0" in out


def test_sample_covers_all_shards_even_when_small(audited_catalog):
    with Catalog.open(audited_catalog, readonly=True) as cat:
        ids = sample_ids(cat, 5, seed=3)
        assert len(ids) == 5 and {cat.shard_index(a) for a in ids} == set(range(5))
        assert sorted(sample_ids(cat, 1000, seed=3)) == sorted(p.adapter_id for p in cat.list(limit=1000))


def test_audit_catches_planted_corrupt_blob(audited_catalog, dense_base, capsys):
    with Catalog.open(audited_catalog) as cat:
        rec = cat.resolve("synth/a0000007")
        good = cat.read_blob(rec)
        bad = good[:-8] + bytes(8)
        cat.shard(cat.shard_index(rec.adapter_id)).write(lambda txn, dbs: txn.put(rec.ref.encode(), bad, db=dbs.blob))
    rep = run_audit(audited_catalog, dense_base, sample=41)
    assert not rep.ok and len(rep.failures) == 1
    assert "synth/a0000007@r1" in rep.failures[0] and "checksum" in rep.failures[0]
    assert run(["catalog", "audit", str(audited_catalog), "--model", str(dense_base), "--sample", "41"]) == 1
    assert "FAIL synth/a0000007" in capsys.readouterr().out


def test_audit_catches_planted_wrong_base_revision(audited_catalog, dense_base):
    base = BaseInfo.from_dir(dense_base)
    wrong = "0" * 32
    template = build_template(target_modules(base.modules, ["q_proj"]), 1, ["q_proj"], "float32", wrong)
    with Catalog.open(audited_catalog) as cat:
        cat.put_revision("evil/wrongbase", template.blob("evil/wrongbase", 0))
    rep = run_audit(audited_catalog, dense_base, sample=41)
    assert [f for f in rep.failures if "evil/wrongbase@r1" in f and wrong in f and base.fingerprint in f]
    assert len(rep.failures) == 1


def test_audit_moe_adapter_through_expert_path(moe_base, tmp_path):
    peft_dir, _ = make_peft(moe_base, tmp_path / "peft", "qwen3_moe", r=2, lora_alpha=4, target_modules=["k_proj"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with Catalog.create(tmp_path / "cat", shards=2) as cat:
        import_peft(cat, "acme/moe", peft_dir, moe_base)
    rep = run_audit(tmp_path / "cat", moe_base, sample=4)
    assert rep.ok and rep.audited == 1 and 0 < rep.max_error < 1e-5
