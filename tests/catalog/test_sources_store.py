"""The catalog's durable tier (catalog/store_s3.py): two catalogs, two "hosts", one moto S3 server.

A write on the writer is published (blob by checksum, record, policy, a log entry); the other
host faults the adapter in on demand with the same bytes; a promote on the writer reaches the
other host at its next poll; a host's replayed writes are not published again; a corrupt blob
is refused and never cached; a store that is down fails the publish with 503, and re-running
the idempotent write publishes once it is back.
"""
from __future__ import annotations

import pytest

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import AdapterNotFound, CorruptBlob, SourceUnavailable
from loraserve.catalog.importer import adapter_blob
from loraserve.catalog.store import Catalog
from loraserve.catalog.store_s3 import ObjectStore, StoreTier

from s3_testing import blob_object, moto_s3

URI = "s3://catalog/prod"


@pytest.fixture(scope="module")
def blobs(tmp_path_factory, dense_base):
    """Three serving blobs of different adapters over dense_base."""
    from catalog_fixtures import make_peft
    base = BaseInfo.from_dir(dense_base)
    out = []
    for seed in (1, 2, 3):
        peft, _ = make_peft(dense_base, tmp_path_factory.mktemp("peft") / f"s{seed}", "qwen3", seed=seed,
                            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        out.append(adapter_blob(peft, base))
    return out


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        yield server


def ensure_bucket(s3) -> None:
    if "catalog" not in [b["Name"] for b in s3.client().list_buckets().get("Buckets", [])]:
        s3.client().create_bucket(Bucket="catalog")


@pytest.fixture
def hosts(s3, tmp_path, request):
    """(writer tier, reader tier) over a fresh bucket prefix."""
    uri = f"{URI}/{request.node.name}"
    ensure_bucket(s3)
    tiers = []
    for name in ("a", "b"):
        cat = Catalog.create(tmp_path / name, shards=2)
        tiers.append(StoreTier(ObjectStore(uri, timeout_s=2.0), cat, poll_s=0.1))
    yield tiers
    for t in tiers:
        t.close()
        t.catalog.close()


def log_count(tier: StoreTier) -> int:
    return len(tier.store.log_after(tier.store.key("log") + "/"))


def test_a_write_is_published_and_faults_in_elsewhere_with_the_same_bytes(hosts, blobs):
    a, b = hosts
    a.catalog.put_revision("acme/x", blobs[1])
    assert log_count(a) == 0  # a new adapter: no host holds it, nothing to follow
    rec = a.catalog.put_revision("acme/x", blobs[0])
    assert a.store.exists(blob_object(a.store, "acme/x", rec.revision))
    assert a.store.policy("acme/x").promoted == rec.revision and log_count(a) == 1
    with pytest.raises(AdapterNotFound):
        b.catalog.resolve("acme/x")
    got = b.fault_in("acme/x")
    assert (got.revision, got.checksum) == (rec.revision, rec.checksum)
    assert b.catalog.read_blob(got) == a.catalog.read_blob(rec)
    assert b.catalog.resolve("acme/x").revision == rec.revision
    assert log_count(a) == 1  # b's replayed writes were not published again


def test_a_promote_reaches_the_other_host_at_its_next_poll(hosts, blobs):
    a, b = hosts
    r1 = a.catalog.put_revision("acme/x", blobs[0])
    r2 = a.catalog.put_revision("acme/x", blobs[1])
    a.catalog.put_revision("acme/other", blobs[2])
    b.poll()  # sets b's cursor (nothing held yet)
    assert b.fault_in("acme/x").revision == r2.revision
    a.catalog.promote("acme/x", r1.revision)  # back to r1: b must follow, copying r1 in
    a.catalog.tag("acme/x", "stable", r1.revision)
    assert b.poll() >= 1
    assert b.catalog.resolve("acme/x").revision == r1.revision
    assert b.catalog.resolve("acme/x", "stable").revision == r1.revision
    with pytest.raises(AdapterNotFound):  # not held: left to fault in when asked for
        b.catalog.resolve("acme/other")
    a.catalog.rollback("acme/x")
    b.poll()
    assert b.catalog.resolve("acme/x").revision == r2.revision


def test_the_poll_thread_follows_promotes(hosts, blobs):
    a, b = hosts
    r1 = a.catalog.put_revision("acme/x", blobs[0])
    a.catalog.put_revision("acme/x", blobs[1])
    b.fault_in("acme/x")
    b.poll()
    b.start()
    a.catalog.promote("acme/x", r1.revision)
    import time
    deadline = time.monotonic() + 30
    while b.catalog.resolve("acme/x").revision != r1.revision:
        assert time.monotonic() < deadline, "the promote never reached the other host"
        time.sleep(0.05)


def test_a_corrupt_blob_is_refused_and_never_cached(hosts, blobs):
    a, b = hosts
    rec = a.catalog.put_revision("acme/x", blobs[0])
    data = bytearray(a.catalog.read_blob(rec))
    data[-1] ^= 0xFF
    a.store.put(blob_object(a.store, "acme/x", rec.revision), bytes(data))
    with pytest.raises(CorruptBlob, match="fails its checksum"):
        b.fault_in("acme/x")
    with pytest.raises(AdapterNotFound):
        b.catalog.resolve("acme/x")


def test_store_down_fails_the_publish_and_a_rerun_publishes(s3, hosts, blobs):
    a, b = hosts
    s3.stop()
    try:
        with pytest.raises(SourceUnavailable):
            a.catalog.put_revision("acme/x", blobs[0])
        assert a.catalog.resolve("acme/x")  # the local commit stands: it serves here
    finally:
        s3.start()
    rec = a.catalog.put_revision("acme/x", blobs[0])  # idempotent: publishes now
    assert b.fault_in("acme/x").checksum == rec.checksum


def test_the_local_cache_keeps_its_bound_dropping_the_least_recently_used(hosts, blobs, tmp_path):
    a, _ = hosts
    for i in range(3):
        a.catalog.put_revision(f"acme/x{i}", blobs[i])
    from loraserve.catalog.isolated import open_for_serving
    size = max(len(b) for b in blobs)
    Catalog.create(tmp_path / "bounded", shards=2).close()
    # as a server holds it: shard hosts map the shards, the drops run there
    b = StoreTier(a.store, open_for_serving(tmp_path / "bounded"), max_bytes=int(2.5 * size),
                  blob_grace_s=0.0)
    try:
        b.fault_in("acme/x0")
        b.fault_in("acme/x1")
        b.touch("acme/x0")  # x1 is now the least recently used
        b.fault_in("acme/x2")
        assert b.dropped == 1
        with pytest.raises(AdapterNotFound):
            b.catalog.resolve("acme/x1")
        assert b.catalog.resolve("acme/x0") and b.catalog.resolve("acme/x2")
        assert b.catalog.stats()["bytes"] <= b.max_bytes  # its blob went too (grace 0)
        assert b.fault_in("acme/x1").checksum == a.catalog.resolve("acme/x1").checksum  # no tombstone
        with pytest.raises(AdapterNotFound):  # x0 was the least recent then
            b.catalog.resolve("acme/x0")
    finally:
        b.close()
        b.catalog.close()


def test_parse_store_uri():
    from loraserve.catalog.errors import CatalogError
    from loraserve.catalog.store_s3 import parse_store_uri
    assert parse_store_uri("s3://b/p") == ("s3://b/p", None)
    assert parse_store_uri("s3://b/p?cache_mb=512") == ("s3://b/p", 512)
    for bad in ("s3://b/p?cache_mb=0", "s3://b/p?size=5", "s3://b/p?cache_mb=x"):
        with pytest.raises(CatalogError):
            parse_store_uri(bad)


def test_catalog_publish_puts_a_materialized_catalog_into_the_store_and_resumes(s3, dense_base, tmp_path, capsys):
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.cli_catalog import run
    Catalog.create(tmp_path / "built", shards=4).close()
    assert materialize(MaterializeConfig(tmp_path / "built", dense_base, 25, rank=2, workers=1, progress=False)).ok
    uri = f"{URI}/bulk"
    ensure_bucket(s3)
    assert run(["catalog", "publish", str(tmp_path / "built"), "--store", uri, "--workers", "4"]) == 0
    assert "adapters: 25, published: 25" in capsys.readouterr().out
    assert run(["catalog", "publish", str(tmp_path / "built"), "--store", uri]) == 0  # a re-run: nothing to do
    assert "adapters: 25, published: 0" in capsys.readouterr().out
    store = ObjectStore(uri)
    assert store.list_after("segments") and not store.list_after("blobs")  # new adapters: in segments
    with Catalog.open(tmp_path / "built") as built, Catalog.create(tmp_path / "empty", shards=2) as empty:
        writer = StoreTier(store, built)
        built.tag("synth/a0000000", "stable", "r1")  # the ordinary publish keeps the segment's places
        writer.close()
        reader = StoreTier(store, empty)
        for adapter_id in ("synth/a0000000", "synth/a0000024"):
            assert reader.fault_in(adapter_id).checksum == built.resolve(adapter_id).checksum
        assert reader.fault_in("synth/a0000000", "stable").revision == "r1"
        reader.close()


def test_catalog_commands_publish_with_store(hosts, dense_base, tmp_path):
    """`loraserve catalog import/promote/rollback/tag --store`: a write made outside any server
    reaches the hosts caching the store."""
    from catalog_fixtures import make_peft
    from loraserve.cli_catalog import run
    a, b = hosts
    uri = a.store.uri
    Catalog.create(tmp_path / "ops", shards=2).close()
    dirs = [make_peft(dense_base, tmp_path / f"peft{seed}", "qwen3", seed=seed, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])[0] for seed in (1, 2)]
    for peft in dirs:
        assert run(["catalog", "import", str(tmp_path / "ops"), "acme/cli", str(peft), "--model", str(dense_base),
                    "--store", uri]) == 0
    assert b.fault_in("acme/cli").revision == "r2"
    b.poll()
    assert run(["catalog", "rollback", str(tmp_path / "ops"), "acme/cli", "--store", uri]) == 0
    assert run(["catalog", "tag", str(tmp_path / "ops"), "acme/cli", "stable", "r1", "--store", uri]) == 0
    b.poll()
    assert b.catalog.resolve("acme/cli").revision == "r1"
    assert b.catalog.resolve("acme/cli", "stable").revision == "r1"
    b.fault_in("acme/cli", "r2")
    assert run(["catalog", "delete", str(tmp_path / "ops"), "acme/cli@r2", "--store", uri]) == 0
    b.poll()
    assert b.catalog.policy("acme/cli").revisions == ["r1"]


def test_a_restarted_host_applies_what_it_missed(hosts, blobs):
    """The cursor is kept beside the shards: a tier made again over the same catalog (a restart)
    reads the log from where the last one stopped, so a promote made while it was down is applied."""
    a, b = hosts
    r1 = a.catalog.put_revision("acme/x", blobs[0])
    a.catalog.put_revision("acme/x", blobs[1])
    b.fault_in("acme/x")
    b.poll()
    b.close()  # "down"
    a.catalog.promote("acme/x", r1.revision)
    again = StoreTier(b.store, b.catalog, skew_s=0.0)  # no window: only what the saved cursor gives
    try:
        assert again.poll() == 1
        assert again.catalog.resolve("acme/x").revision == r1.revision
    finally:
        again.close()


def test_a_delete_is_published_and_every_host_drops_it_at_its_next_poll(hosts, blobs, tmp_path):
    from loraserve.catalog.deletes import delete
    from loraserve.catalog.errors import RevisionNotFound
    a, b = hosts
    r1 = a.catalog.put_revision("acme/x", blobs[0])
    a.catalog.put_revision("acme/x", blobs[1])
    a.catalog.put_revision("acme/y", blobs[2])
    b.poll()
    b.fault_in("acme/x")
    b.fault_in("acme/x", r1.revision)
    b.fault_in("acme/y")
    delete(a.catalog, "acme/x", r1.revision)  # one revision
    delete(a.catalog, "acme/y", force=True)  # the whole adapter
    assert not a.store.exists(a.store.record_key("acme/x", r1.revision))
    assert b.poll() == 2
    assert b.catalog.policy("acme/x").revisions == ["r2"]
    with pytest.raises(RevisionNotFound):
        b.catalog.resolve("acme/x", r1.revision)
    with pytest.raises(AdapterNotFound):
        b.catalog.resolve("acme/y")
    with Catalog.create(tmp_path / "fresh", shards=2) as empty:  # a host that never held it
        fresh = StoreTier(a.store, empty)
        with pytest.raises(AdapterNotFound):
            fresh.fault_in("acme/y")
        fresh.close()
    stale = b.catalog.put_revision("acme/y", blobs[2])  # b's write after the delete: a new id
    assert stale.revision == "r2" and a.store.policy("acme/y").revisions == ["r2"]  # r1 stays taken


def test_compaction_keeps_the_log_small_and_a_host_polling_across_it_loses_nothing(hosts, blobs):
    from loraserve.catalog.store_log import compact
    a, b = hosts
    r1 = a.catalog.put_revision("acme/x", blobs[0])
    r2 = a.catalog.put_revision("acme/x", blobs[1])
    b.fault_in("acme/x")
    b.poll()
    a.catalog.promote("acme/x", r1.revision)
    assert compact(a.store, keep_s=0) >= 1 and log_count(a) == 0
    assert b.poll() == 1  # the pruned entry comes from the snapshot
    assert b.catalog.resolve("acme/x").revision == r1.revision
    a.catalog.rollback("acme/x")
    assert compact(a.store, keep_s=0, horizon_s=0) == 1  # the snapshot names nothing now
    assert b.poll() == 1  # past the snapshot's horizon: every held adapter re-checked
    assert b.catalog.resolve("acme/x").revision == r2.revision
    assert b.poll() == 0 and compact(a.store, keep_s=0) == 0


def test_after_a_restart_the_bound_counts_what_is_on_disk(hosts, blobs, tmp_path):
    """A tier made over a catalog that already holds adapters (a restarted host) counts them:
    the oldest changed goes first when the bound is below what is on disk."""
    a, _ = hosts
    for i in range(3):
        a.catalog.put_revision(f"acme/x{i}", blobs[i])
    with Catalog.create(tmp_path / "cache", shards=2) as cache:
        before = StoreTier(a.store, cache)  # no bound: holds all three
        for i in range(3):
            before.fault_in(f"acme/x{i}")
        before.close()
        size = max(len(b) for b in blobs)
        after = StoreTier(a.store, cache, max_bytes=int(2.5 * size), blob_grace_s=0.0)
        try:
            assert after.bound.seed() == 3 and after.bound.counted == cache.stats()["bytes"]
            assert after.evict() == 1
            with pytest.raises(AdapterNotFound):
                cache.resolve("acme/x0")
            assert cache.resolve("acme/x1") and cache.resolve("acme/x2")
            assert cache.stats()["bytes"] <= after.max_bytes
        finally:
            after.close()


def test_one_listing_finds_every_stored_policy_of_a_range(hosts, blobs):
    """Ids sort otherwise than their keys ("a/b" < "a/b-c", but "a/b-c.json" < "a/b.json"): the
    listing of the range from the least key to the greatest still finds each one."""
    from loraserve.catalog.store_bulk import stored_policies
    a, _ = hosts
    ids = ["acme/b", "acme/b-c", "acme/b.d", "acme/b_e"]
    for adapter_id in ids[:3]:
        a.catalog.put_revision(adapter_id, blobs[0])
    found = stored_policies(a.store, ids)
    assert found == {a.store.policy_key(i) for i in ids[:3]}


def test_a_poll_that_fails_midway_is_read_again(hosts, blobs):
    """A poll lists the log, then fails to apply an entry (here the newly promoted revision's
    blob is damaged in the store; a store going down midway is the same): the next poll reads
    the entry again and applies it once the store serves the blob."""
    a, b = hosts
    r1 = a.catalog.put_revision("acme/x", blobs[0])
    a.catalog.put_revision("acme/x", blobs[1])
    b.fault_in("acme/x")  # holds r2 only
    b.poll()
    good = a.catalog.read_blob(r1)
    a.store.put(blob_object(a.store, "acme/x", r1.revision), good[:-1])
    a.catalog.promote("acme/x", r1.revision)
    with pytest.raises(CorruptBlob):
        b.poll()
    a.store.put(blob_object(a.store, "acme/x", r1.revision), good)
    assert b.poll() == 1 and b.catalog.resolve("acme/x").revision == r1.revision


def test_an_import_from_a_source_while_the_store_was_down_yields_to_the_store(s3, hosts, blobs, dense_base,
                                                                             tmp_path):
    """The rule for a store and a source holding different bytes for one id: the store is the
    fleet's copy of every adapter it holds. A host that fetched the adapter from a source while
    the store was down (under a revision id named after its bytes) takes the store's promoted
    revision at the first poll that reaches the store and drops its own; an adapter the store
    lacks is published from the source's copy."""
    from catalog_fixtures import make_peft
    from loraserve.catalog.sources import AdapterSources, importer
    a, b = hosts
    root = tmp_path / "sources"
    for seed, name in ((5, "x"), (6, "y")):
        make_peft(dense_base, root / "acme" / name, "qwen3", seed=seed, r=4, lora_alpha=8,
                  target_modules=["q_proj", "v_proj"])
    sources = AdapterSources([f"{root}/{{tenant}}/{{name}}"], max_bytes=1 << 26)
    base = BaseInfo.from_dir(dense_base)
    stored = a.catalog.put_revision("acme/x", blobs[0])  # the store holds x, other bytes than the source's
    s3.stop()
    try:
        for adapter_id in ("acme/x", "acme/y"):
            into = importer(b.catalog, adapter_id, dense_base, base, by_content=True)
            got = b.provisional(adapter_id, lambda: sources.fetch(adapter_id, into))
            assert got.revision.startswith("src-") and b.catalog.resolve(adapter_id) == got
    finally:
        s3.start()
    provisional_x = b.catalog.resolve("acme/x")
    b.poll()
    x = b.catalog.resolve("acme/x")
    assert (x.revision, x.checksum) == (stored.revision, stored.checksum)
    assert b.catalog.policy("acme/x").revisions == [stored.revision]  # its own is gone, unpublished
    assert b.catalog.read_blob(x) == blobs[0] and provisional_x.checksum != stored.checksum
    assert a.store.policy("acme/x").revisions == [stored.revision]
    y = b.catalog.resolve("acme/y")
    assert a.store.policy("acme/y").promoted == y.revision and a.fault_in("acme/y").checksum == y.checksum


def test_an_import_on_a_host_without_the_adapter_is_numbered_after_the_store(hosts, dense_base, tmp_path, blobs):
    """The store holds acme/both r1; a catalog that lacks it imports other bytes with
    `catalog import --store`: the store's r1 comes in first, the import is r2, published and
    followed by the other host (never a second r1 of other bytes)."""
    from catalog_fixtures import make_peft
    from loraserve.cli_catalog import run
    a, b = hosts
    theirs = b.catalog.put_revision("acme/both", blobs[1])
    a.fault_in("acme/both")
    Catalog.create(tmp_path / "ops", shards=2).close()
    peft, _ = make_peft(dense_base, tmp_path / "peft", "qwen3", seed=9, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj"])
    assert run(["catalog", "import", str(tmp_path / "ops"), "acme/both", str(peft), "--model", str(dense_base),
                "--store", a.store.uri]) == 0
    with Catalog.open(tmp_path / "ops") as ops:
        assert ops.policy("acme/both").revisions == ["r1", "r2"]
        assert ops.resolve("acme/both", "r1").checksum == theirs.checksum
        mine = ops.resolve("acme/both")
    assert mine.revision == "r2" and a.store.policy("acme/both").promoted == "r2"
    a.poll()
    assert a.catalog.resolve("acme/both").checksum == mine.checksum


def test_a_named_save_of_a_revision_the_store_holds_is_compared_by_checksum(hosts, blobs):
    """A training save names its revision (`s1`, a checkpoint's name). On a host that lacks the
    adapter while the store holds that revision, the save is compared with the store's by
    checksum: other bytes are refused before anything is written (the store's copy wins),
    equal bytes go on and upload nothing, and a revision the store deleted is never reused."""
    from loraserve.catalog.deletes import delete
    from loraserve.catalog.errors import RevisionExists
    a, b = hosts
    a.catalog.put_revision("acme/run", blobs[0], revision="s1", source="tinker:run-a")
    segments = set(a.store.list_after("segments"))
    with pytest.raises(RevisionExists, match="other bytes"):
        b.catalog.put_revision("acme/run", blobs[1], revision="s1", source="tinker:run-b")
    with pytest.raises(AdapterNotFound):
        b.catalog.resolve("acme/run")  # nothing written here
    same = b.catalog.put_revision("acme/run", blobs[0], revision="s1", source="tinker:run-b")
    assert same.checksum == a.catalog.resolve("acme/run", "s1").checksum
    assert set(a.store.list_after("segments")) == segments  # equal bytes: nothing uploaded
    b.catalog.put_revision("acme/run", blobs[1], revision="s2", source="tinker:run-b")  # a new name: published
    assert a.fault_in("acme/run", "s2").checksum == b.catalog.resolve("acme/run", "s2").checksum
    delete(a.catalog, "acme/run", "s1", force=True)
    fresh = StoreTier(a.store, Catalog.create(b.catalog.path.parent / "c", shards=2))
    try:
        with pytest.raises(RevisionExists, match="deleted"):
            fresh.catalog.put_revision("acme/run", blobs[2], revision="s1", source="tinker:run-c")
    finally:
        fresh.close()
        fresh.catalog.close()
