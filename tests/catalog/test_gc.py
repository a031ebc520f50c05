"""`catalog delete` and `catalog gc`: a deleted revision or adapter is gone for every reader at
once (another open Catalog included), its id is never reused, the promoted one needs --force,
and gc frees the blobs' pages, which the next writes reuse."""
from __future__ import annotations

import json

import pytest
import torch

from loraserve.catalog.deletes import RevisionServed, collect_garbage, delete
from loraserve.catalog.errors import AdapterNotFound, RevisionExists, RevisionNotFound
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.store import Catalog
from loraserve.cli_catalog import run


def blob(seed: int, hidden: int = 8, rank: int = 2) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(rank, hidden, generator=g),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(hidden, rank, generator=g)}
    return save_revision(AdapterWeights("fp-a", rank, ["q_proj"], torch.float32, t, "test"))


@pytest.fixture
def cat(tmp_path):
    with Catalog.create(tmp_path / "cat", shards=2) as c:
        yield c


def _blob_keys(cat: Catalog) -> set[bytes]:
    keys = set()
    for i in range(cat.shards):
        keys |= set(cat.shard(i).read(lambda txn, dbs: [bytes(k) for k in txn.cursor(
            db=dbs.blob).iternext(values=False)], default=[]))
    return keys


def test_delete_a_revision_then_gc_its_blob(cat) -> None:
    for seed in range(3):
        cat.put_revision("acme/a", blob(seed))  # r1, r2, r3 (r3 promoted)
    cat.tag("acme/a", "stable", "r2")
    cat.promote("acme/a", "r2")  # previous: r3
    assert cat.resolve("acme/a", "r3").revision == "r3"  # in the resolve cache now
    before = cat.stats()["bytes"]
    with pytest.raises(RevisionServed, match="promoted"):
        delete(cat, "acme/a", "stable")  # names the promoted revision
    done = delete(cat, "acme/a", "r3")
    assert done.revisions == ["r3"] and done.policy.previous is None
    with pytest.raises(RevisionNotFound):
        cat.resolve("acme/a", "r3")
    assert cat.stats()["bytes"] == before - done.bytes
    assert b"acme/a@r3" in _blob_keys(cat)  # until gc: a request that resolved it reads on
    assert collect_garbage(cat, min_age=3600).blobs_pending == 1
    rep = collect_garbage(cat, min_age=0)
    assert (rep.blobs_deleted, rep.bytes_freed, rep.blobs_pending) == (1, done.bytes, 0)
    assert b"acme/a@r3" not in _blob_keys(cat) and cat.stats()["bytes"] == before - done.bytes
    assert cat.put_revision("acme/a", blob(9), promote=False).revision == "r4"  # r3 stays taken
    with pytest.raises(RevisionExists, match="never reused"):
        cat.put_revision("acme/a", blob(9), revision="r3")
    done = delete(cat, "acme/a", "r2", force=True)  # the promoted one, and its tag, go
    policy = cat.policy("acme/a")
    assert (policy.revisions, policy.promoted, policy.tags) == (["r1", "r4"], None, {})
    with pytest.raises(RevisionNotFound, match="no promoted revision"):
        cat.resolve("acme/a")


def test_delete_an_adapter_then_gc_frees_pages_the_next_writes_reuse(cat) -> None:
    for n in range(12):
        cat.put_revision(f"acme/big{n}", blob(n, hidden=512, rank=16))
    cat.put_revision("acme/keep", blob(99))
    disk = cat.stats()["disk_bytes"]
    for n in range(12):
        delete(cat, f"acme/big{n}", force=True)
    with pytest.raises(AdapterNotFound):
        cat.resolve("acme/big0")
    assert [p.adapter_id for p in cat.list("acme/")] == ["acme/keep"]
    assert collect_garbage(cat, min_age=0).blobs_deleted == 12
    written = sum(cat.put_revision(f"acme/new{n}", blob(100 + n, hidden=512, rank=16)).size
                  for n in range(12))  # as many bytes again: mostly into the freed pages
    assert cat.stats()["disk_bytes"] - disk < written / 2  # (LMDB keeps some back, in runs)
    assert cat.resolve("acme/new3").revision == "r1"
    assert cat.put_revision("acme/big0", blob(5)).revision == "r2"  # re-created, r1 stays taken


def test_cli_delete_refuses_the_promoted_revision_and_audits(cat, tmp_path, capsys) -> None:
    cat.put_revision("acme/a", blob(1))
    cat.put_revision("acme/a", blob(2), promote=False)
    cat.close()
    audit = tmp_path / "audit.jsonl"
    d, log = str(cat.path), ["--audit-log", str(audit)]
    assert run(["catalog", "delete", d, "acme/a@r1", *log]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err
    assert run(["catalog", "delete", d, "acme/a@r2", *log]) == 0
    assert "deleted acme/a@r2" in capsys.readouterr().out
    assert run(["catalog", "delete", d, "acme/a", "--force", *log]) == 0
    assert "adapter removed" in capsys.readouterr().out
    assert run(["catalog", "gc", d, "--min-age", "0", *log]) == 0
    assert "blobs deleted: 2" in capsys.readouterr().out
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(ln["action"], ln["adapter"], ln["revision"], ln["outcome"]) for ln in lines] == [
        ("delete", "acme/a", "r1", "failed"), ("delete", "acme/a", "r2", "ok"),
        ("delete", "acme/a", None, "ok"), ("gc", None, None, "ok")]
    assert lines[0]["status"] == 409
