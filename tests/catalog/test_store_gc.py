"""The durable tier's GC (catalog/store_gc.py) against moto's S3 server: what no live revision
names goes, what one does stays, young objects wait, and a publish racing the GC loses nothing."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from loraserve.catalog.deletes import delete
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.store import Catalog
from loraserve.catalog.store_bulk import publish_catalog
from loraserve.catalog.format import blob_checksum
from loraserve.catalog.store_compact import retired
from loraserve.catalog.store_gc import KINDS, collect, mark, StoreGCReport, sweep
from loraserve.catalog.store_objects import PolicyDoc
from loraserve.catalog.store_s3 import ObjectStore, StoreTier

from s3_testing import blob_object, moto_s3

URI = "s3://catalog/gc"
LATER = 10 * 86400.0  # a GC "run" this much later: every object is old enough


def blob(seed: int) -> bytes:
    """A small serving blob (rank 2, hidden 8)."""
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(2, 8, generator=g),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(8, 2, generator=g)}
    return save_revision(AdapterWeights("fp-a", 2, ["q_proj"], torch.float32, t, "test"))


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        server.client().create_bucket(Bucket="catalog")
        yield server


@pytest.fixture
def tier(s3, tmp_path, request):
    cat = Catalog.create(tmp_path / "host", shards=2)
    t = StoreTier(ObjectStore(f"{URI}/{request.node.name}", timeout_s=5.0), cat)
    yield t
    t.close()
    cat.close()


def keys(store: ObjectStore, kind: str) -> set[str]:
    return {k for k, _, _ in store.list_objects(kind)}


def gc(store: ObjectStore, **kw) -> StoreGCReport:
    return collect(store, min_age_s=kw.pop("min_age_s", 60.0), now=kw.pop("now", time.time() + LATER), **kw)


def fault_in_elsewhere(store: ObjectStore, tmp_path, refs: list[str]) -> list[str]:
    """The checksums a second host, its local catalog empty, faults `refs` in with from the store."""
    other = StoreTier(store, Catalog.create(tmp_path / "other", shards=2))
    try:
        return [other.fault_in(ref).checksum for ref in refs]
    finally:
        other.close()
        other.catalog.close()



def test_segments_no_live_revision_names_are_deleted(tier):
    store, cat = tier.store, tier.catalog
    x1 = cat.put_revision("acme/x", blob(1))
    x2 = cat.put_revision("acme/x", blob(2))
    y1 = cat.put_revision("acme/y", blob(1))  # the same bytes as x@r1, in a segment of its own
    assert len(keys(store, "segments")) == 3 and not keys(store, "blobs") and not keys(store, "revisions")
    kept = {blob_object(store, "acme/x", x2.revision), blob_object(store, "acme/y", y1.revision)}
    store.put(store.key("segments", "ghost"), blob(9))  # a publish that died before its policy
    young = gc(store, now=time.time())
    assert (young.pending, sum(young.deleted.values())) == (1, 0)  # the ghost, young: it waits
    delete(cat, "acme/x", x1.revision, force=True)
    rep = gc(store)
    assert rep.deleted == {"segments": 2, "blobs": 0, "revisions": 0}  # the ghost and x@r1's
    assert keys(store, "segments") == kept
    delete(cat, "acme/y", force=True)
    dry = gc(store, dry_run=True)
    assert dry.deleted["segments"] == 1 and keys(store, "segments") == kept
    rep = gc(store)
    assert rep.deleted["segments"] == 1 and rep.bytes_freed == y1.size
    assert keys(store, "segments") == {blob_object(store, "acme/x", x2.revision)}
    assert (rep.policies, rep.live_revisions) == (2, 1)  # y's policy stays, with no revision


def test_blobs_and_records_from_before_segments_are_read_and_collected(tier, tmp_path):
    """A store written before segments: a revision's blob under blobs/, its record under
    revisions/, a policy without `placed`. It faults in, and the GC keeps both while the
    policy names the revision and deletes both once it does not."""
    store, cat = tier.store, tier.catalog
    x = cat.put_revision("acme/old", blob(5))
    store.put(store.blob_key(x.checksum), cat.read_blob(x))
    store.put(store.record_key("acme/old", x.revision), x.to_json())
    store.put_policy(PolicyDoc(cat.policy("acme/old")))  # no `placed`: the segment is garbage
    rep = gc(store)
    assert rep.deleted == {"segments": 1, "blobs": 0, "revisions": 0} and rep.live_revisions == 1
    assert fault_in_elsewhere(store, tmp_path, ["acme/old"]) == [x.checksum]
    policy = cat.policy("acme/old")
    policy.revisions, policy.promoted = [], None
    store.put_policy(PolicyDoc(policy))
    assert gc(store).deleted == {"segments": 0, "blobs": 1, "revisions": 1}


def test_a_segment_goes_only_when_no_live_revision_points_into_it(tier, tmp_path):
    store, cat = tier.store, tier.catalog
    tier.close()  # built unpublished, then published in bulk: two segments of two adapters
    for i in range(4):
        cat.put_revision(f"acme/s{i}", blob(10 + i))
    tier = StoreTier(store, cat)
    publish_catalog(cat, tier, workers=2, progress=False)
    segments = keys(store, "segments")
    assert len(segments) == 2 and not keys(store, "blobs")
    for i in (0, 1, 2):
        delete(cat, f"acme/s{i}", force=True)
    rep = gc(store)
    assert rep.deleted["segments"] == 1 and rep.dead_in_live_segments == len(blob(12))
    assert fault_in_elsewhere(store, tmp_path, ["acme/s3"]) == [cat.resolve("acme/s3").checksum]
    tier.close()


def test_a_publish_between_the_mark_and_the_sweep_loses_nothing(tier, tmp_path):
    """The mark has read every policy; then a publish of the same bytes as a dead revision's;
    then the sweep, with a cutoff between the two. The publish wrote a new segment, never the
    dead one's, so the sweep deletes the dead segment and the new one waits (younger than the
    cutoff): nothing a policy names goes, whatever the order of the GC's requests and the
    publish's (store_gc: every swept key is written once)."""
    store, cat = tier.store, tier.catalog
    x = cat.put_revision("acme/x", blob(7))
    dead = blob_object(store, "acme/x", x.revision)
    delete(cat, "acme/x", force=True)
    time.sleep(2.5)  # past the listing's one-second LastModified
    start = time.time()
    with ThreadPoolExecutor(2) as pool:
        live = mark(store, pool)  # x is dead: its segment is garbage now
    assert dead not in live.keys
    y = cat.put_revision("acme/y", blob(7))  # the same bytes, published between mark and sweep
    report = StoreGCReport()
    for kind in KINDS:
        sweep(store, kind, live, start - 1.0, report, dry_run=False)
    assert (report.deleted["segments"], report.pending) == (1, 1)
    assert keys(store, "segments") == {blob_object(store, "acme/y", y.revision)} != {dead}
    assert fault_in_elsewhere(store, tmp_path, ["acme/y"]) == [y.checksum]


def test_a_mostly_dead_segment_is_rewritten_and_the_old_one_retired_until_the_cutoff(tier, tmp_path):
    """Two of six adapters of a bulk-published segment live (under REWRITE_BELOW): the GC moves
    them to a new segment and retires the old one. A reader that read a policy before the
    rewrite still finds the old segment until a GC whose cutoff is past the retirement; a
    publish that writes back a policy read before the rewrite makes the old segment live again,
    and nothing it names is deleted."""
    store, cat = tier.store, tier.catalog
    tier.close()
    for i in range(6):
        cat.put_revision(f"acme/m{i}", blob(20 + i))
    tier = StoreTier(store, cat)
    publish_catalog(cat, tier, workers=1, progress=False)
    [old] = keys(store, "segments")
    before = {i: store.policy_doc(f"acme/m{i}") for i in (4, 5)}  # read before the rewrite
    for i in range(4):
        delete(cat, f"acme/m{i}", force=True)
    rep = gc(store)
    live = [cat.resolve(f"acme/m{i}") for i in (4, 5)]
    assert (rep.rewritten, rep.rewritten_bytes) == (1, sum(r.size for r in live))
    [new] = keys(store, "segments") - {old}
    for i, rec in zip((4, 5), live):
        doc = store.policy_doc(f"acme/m{i}")
        assert store.locate(doc, rec.revision)[1]["segment"] == new
        assert blob_checksum(store.blob(*store.locate(before[i], rec.revision))) == rec.checksum  # old still read
    assert gc(store, now=time.time()).deleted["segments"] == 0  # retired after this cutoff: it waits
    store.put_policy(before[5])  # a publish that read m5's policy before the rewrite writes it back
    rep = gc(store)  # the old segment is m5's again: kept, and m5 moved again (to a third segment)
    assert (rep.deleted["segments"], rep.rewritten) == (0, 1) and old in keys(store, "segments")
    assert fault_in_elsewhere(store, tmp_path, [f"acme/m{i}" for i in (4, 5)]) == [r.checksum for r in live]
    rep = gc(store)  # nothing names the old segment now, retired before this cutoff
    assert rep.deleted["segments"] == 1 and old not in keys(store, "segments") and len(keys(store, "segments")) == 2
    assert retired(store) == {}


def test_the_mark_reads_only_the_policies_changed_since_the_last_one(tier):
    """store_mark: a second mark takes what an unchanged policy (same listed ETag) named from
    the last mark's cache; a changed one is read again; the result is a full read's."""
    store, cat = tier.store, tier.catalog
    for i in range(5):
        cat.put_revision(f"acme/k{i}", blob(40 + i))
    reads = []
    get = store.get_with_etag
    store.get_with_etag = lambda key: reads.append(key) or get(key)  # counts; the real request is made
    with ThreadPoolExecutor(2) as pool:
        first = mark(store, pool)
        assert len(reads) == 5
        again = mark(store, pool)
        assert len(reads) == 5 and again.keys == first.keys and again.policies == 5
        delete(cat, "acme/k1", force=True)
        cat.put_revision("acme/k5", blob(45))
        changed = mark(store, pool)
        assert sorted(reads[5:]) == [store.policy_key("acme/k1"), store.policy_key("acme/k5")]
        full = mark(store, pool, cached=False)
    assert (changed.keys, changed.segments, changed.revisions) == (full.keys, full.segments, full.revisions) \
        and changed.revisions == 5
    store.put(store.key("gc-mark.json.gz"), b"not gzip")  # an unreadable cache: every policy is read
    with ThreadPoolExecutor(2) as pool:
        before = len(reads)
        assert mark(store, pool).keys == full.keys and len(reads) - before == 6


def test_store_gc_command(tier, capsys):
    from loraserve.cli_catalog import run
    store, cat = tier.store, tier.catalog
    cat.put_revision("acme/x", blob(3))
    delete(cat, "acme/x", force=True)
    assert run(["catalog", "store-gc", "--store", store.uri, "--min-age", "60"]) == 1  # below the floor
    assert "--min-age must be" in capsys.readouterr().err
    assert run(["catalog", "store-gc", "--store", store.uri]) == 0
    out = capsys.readouterr().out
    assert "live: 1 adapters, 0 revisions; deleted: 0 segments, 0 blobs, 0 revisions" in out
    assert "pending (written < 86400 s ago): 1" in out
