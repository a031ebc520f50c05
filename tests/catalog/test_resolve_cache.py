"""`Catalog.resolve` answers cached per shard write generation (`ResolveCache`).

A hit reads no LMDB record; any write to the adapter's shard, by this process or another one
(a new revision, promote, rollback, tag, a sync's deletes), makes the cached answers of that
shard stale at once, so a resolve right after the write sees the new revision or a 404; and
the shard's health is still checked on every hit.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loraserve.catalog.errors import AdapterNotFound, ShardUnavailable
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.store import Catalog, ResolveCache
from loraserve.catalog.sync import sync_catalog

from server.adapter_files import restore, truncate


def blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(4, 64, generator=g),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(64, 4, generator=g)}
    return save_revision(AdapterWeights("fp", 4, ["q_proj"], torch.float32, t, "test"))


@pytest.fixture
def cat(tmp_path):
    with Catalog.create(tmp_path / "cat", shards=2) as c:
        c.put_revision("acme/a", blob(1))  # r1, promoted
        c.put_revision("acme/a", blob(2), promote=False)  # r2
        yield c


def _no_reads(c: Catalog, monkeypatch) -> None:
    """Make any LMDB read of the catalog fail the test."""
    for i in range(c.shards):
        monkeypatch.setattr(c.shard(i), "read", lambda *a, **k: pytest.fail("an LMDB read on a hit"))


def test_a_hit_reads_no_record(cat, monkeypatch) -> None:
    first = cat.resolve("acme/a")
    by_rev = cat.resolve("acme/a", "r2")
    _no_reads(cat, monkeypatch)
    assert cat.resolve("acme/a") is first and first.revision == "r1"
    assert cat.resolve("acme/a", "r2") is by_rev


@pytest.mark.parametrize("write", ["promote", "rollback", "tag", "new revision", "other adapter"])
def test_any_write_to_the_shard_is_seen_by_the_next_resolve(cat, write) -> None:
    cat.promote("acme/a", "r2")
    assert cat.resolve("acme/a").revision == "r2"
    cat.tag("acme/a", "stable", "r1")
    assert cat.resolve("acme/a", "stable").revision == "r1"
    expected = {"promote": "r1", "rollback": "r1", "tag": "r2", "new revision": "r3",
                "other adapter": "r2"}[write]
    if write == "promote":
        cat.promote("acme/a", "r1")
    elif write == "rollback":
        cat.rollback("acme/a")
    elif write == "tag":
        cat.tag("acme/a", "stable", "r2")
        assert cat.resolve("acme/a", "stable").revision == "r2"
    elif write == "new revision":
        cat.put_revision("acme/a", blob(3))
    else:  # a write to the same shard about another adapter: stale entries are only re-read
        other = next(f"acme/o{i}" for i in range(100)
                     if cat.shard_index(f"acme/o{i}") == cat.shard_index("acme/a"))
        cat.put_revision(other, blob(4))
    assert cat.resolve("acme/a").revision == expected


def _elsewhere(code: str) -> None:
    """Run `code` (with Catalog and sync_catalog imported) in another Python process."""
    prelude = "from loraserve.catalog.store import Catalog\nfrom loraserve.catalog.sync import sync_catalog\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_write_by_another_process_is_seen_by_the_next_resolve(cat) -> None:
    assert cat.resolve("acme/a").revision == "r1"  # cached
    _elsewhere(f"with Catalog.open({str(cat.path)!r}) as c:\n    c.promote('acme/a', 'r2')")
    assert cat.resolve("acme/a").revision == "r2"


def test_a_sync_that_deletes_the_adapter_makes_it_404(tmp_path) -> None:
    with Catalog.create(tmp_path / "old", shards=2) as old:
        old.put_revision("acme/b", blob(5))
        old.put_revision("acme/c", blob(6))
    with Catalog.create(tmp_path / "new", shards=2) as new:  # acme/b is gone here
        new.put_revision("acme/c", blob(6))
    sync_catalog(tmp_path / "old", tmp_path / "replica")
    with Catalog.open(tmp_path / "replica", readonly=True) as replica:
        assert replica.resolve("acme/b").revision == "r1"  # cached
        _elsewhere(f"sync_catalog({str(tmp_path / 'new')!r}, {str(tmp_path / 'replica')!r})")
        with pytest.raises(AdapterNotFound):
            replica.resolve("acme/b")
        assert replica.resolve("acme/c").revision == "r1"


def test_a_hit_still_checks_the_shard(cat) -> None:
    cat.resolve("acme/a")
    data = cat.path / f"shard-{cat.shard_index('acme/a'):03d}" / "data.mdb"
    saved = truncate(data, 4096)  # the meta pages are gone
    try:
        with pytest.raises(ShardUnavailable):
            cat.resolve("acme/a")
    finally:
        restore(data, saved)
    assert cat.resolve("acme/a").revision == "r1"


def test_cache_is_a_bounded_lru() -> None:
    cache = ResolveCache(capacity=2)
    cache.put(("a", None), 1, "A")
    cache.put(("b", None), 1, "B")
    assert cache.get(("a", None), 1) == "A"  # a is now the most recent
    cache.put(("c", None), 1, "C")
    assert len(cache) == 2 and cache.get(("b", None), 1) is None
    assert cache.get(("a", None), 2) is None  # another generation: stale
    assert cache.get(("c", None), 1) == "C"
