"""Pager against a real on-disk catalog: single-flight, CPU-cache hits, errors to exactly the askers."""
import dataclasses
import threading

import pytest
import torch
from adapter_fakes import FINGERPRINT, make_weights, tiny_specs

from loraserve.catalog.errors import AdapterNotFound, BaseMismatch, CorruptBlob, InvalidAdapterId, RevisionNotFound
from loraserve.catalog.layout import load_revision, save_revision
from loraserve.catalog.store import Catalog
from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.pager import Pager, record_key

SPECS = tiny_specs()
WAIT = 30  # generous bound on waits so a broken pager fails instead of hanging


class CountingCatalog:
    """The real catalog, counting blob reads per revision; reads wait at `gate` while it is clear."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.reads: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def resolve(self, adapter_id, revision=None):
        return self.catalog.resolve(adapter_id, revision)

    def read_blobs(self, records):
        with self.lock:
            for record in records:
                self.reads[record.ref] = self.reads.get(record.ref, 0) + 1
        assert self.gate.wait(WAIT)
        return self.catalog.read_blobs(records)


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog.create(tmp_path / "catalog", shards=4)
    for i, rank in enumerate([2, 4, 1]):
        cat.put_revision(f"acme/a{i}", save_revision(make_weights(SPECS, rank, seed=i)))
    cat.put_revision("acme/a0", save_revision(make_weights(SPECS, 3, seed=9)), promote=False)
    cat.put_revision("other/x", save_revision(make_weights(SPECS, 2, fingerprint="fp-other-base")))
    yield CountingCatalog(cat)
    cat.close()


@pytest.fixture
def pager(catalog):
    with Pager(catalog, CpuCache(max_bytes=1 << 20), FINGERPRINT, workers=4) as p:
        yield p


def page_in_count(pager: Pager, source: str) -> float:
    """Observations of the pager's page-in histogram for one source tier."""
    return next(s.value for family in pager.page_in_seconds.collect() for s in family.samples
                if s.name.endswith("_count") and s.labels["source"] == source)


def corrupt(catalog: CountingCatalog, record) -> None:
    """Flip the stored blob's last byte (its record and checksum stay)."""
    shard = catalog.catalog.shard(catalog.catalog.shard_index(record.adapter_id))

    def flip(txn, dbs):
        blob = bytearray(txn.get(record.ref.encode(), db=dbs.blob))
        blob[-1] ^= 0xFF
        txn.put(record.ref.encode(), bytes(blob), db=dbs.blob)

    shard.write(flip)


def fetch_from_threads(pager: Pager, records: list) -> list:
    """Each record fetched by its own thread at once; returns a Future per record."""
    futures = [None] * len(records)
    barrier = threading.Barrier(len(records))

    def ask(i):
        barrier.wait(WAIT)
        futures[i] = pager.fetch(records[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return futures


def test_resolve_promoted_and_explicit_revisions(pager):
    assert pager.resolve("acme/a0").revision == "r1"
    record = pager.resolve("acme/a0@r2")
    assert (record.adapter_id, record.revision, record.rank) == ("acme/a0", "r2", 3)


@pytest.mark.parametrize("ref, error, status", [
    ("acme", InvalidAdapterId, 400), ("../etc/passwd", InvalidAdapterId, 400),
    ("acme/nope", AdapterNotFound, 404), ("acme/a0@r9", RevisionNotFound, 404),
    ("other/x", BaseMismatch, 409),
])
def test_resolve_errors_carry_their_status(pager, ref, error, status):
    with pytest.raises(error) as info:
        pager.resolve(ref)
    assert info.value.status == status


def test_base_mismatch_names_both_fingerprints(pager):
    with pytest.raises(BaseMismatch, match="fp-other-base.*fp-tiny-base"):
        pager.resolve("other/x")


def test_singleflight_one_catalog_read_for_many_concurrent_fetches(pager, catalog):
    record = pager.resolve("acme/a1")
    catalog.gate.clear()  # hold the read until every thread has asked
    futures = fetch_from_threads(pager, [record] * 8)
    catalog.gate.set()
    results = [f.result(WAIT) for f in futures]
    assert catalog.reads == {"acme/a1@r1": 1}
    assert all(r is results[0] for r in results) and results[0].rank == 4
    stats = pager.stats
    assert (stats.disk_reads, stats.singleflight_joins, stats.cpu_misses) == (1, 7, 8)


def test_cpu_cache_hit_is_done_at_once_without_a_read(pager, catalog):
    record = pager.resolve("acme/a2")
    first = pager.fetch(record).result(WAIT)
    again = pager.fetch(record)
    assert again.done() and again.result() is first
    assert catalog.reads == {"acme/a2@r1": 1}
    assert pager.stats.cpu_hits == 1
    assert page_in_count(pager, "cpu") == 1 and page_in_count(pager, "disk") == 1
    assert record_key(record) in pager.cpu_cache


def test_weights_match_what_was_stored(pager):
    weights = pager.fetch(pager.resolve("acme/a0@r2")).result(WAIT)
    expected = make_weights(SPECS, 3, seed=9)
    assert weights.tensors.keys() == expected.tensors.keys()
    assert all(torch.equal(weights.tensors[n], t) for n, t in expected.tensors.items())


def test_errors_reach_exactly_the_requests_that_asked(pager, catalog):
    bad, good = pager.resolve("acme/a0"), pager.resolve("acme/a1")
    corrupt(catalog, bad)
    catalog.gate.clear()
    futures = fetch_from_threads(pager, [bad, good, bad, good, bad])
    catalog.gate.set()
    for i in (0, 2, 4):
        with pytest.raises(CorruptBlob) as info:
            futures[i].result(WAIT)
        assert info.value.status == 500
    assert all(futures[i].result(WAIT).rank == 4 for i in (1, 3))
    assert catalog.reads == {"acme/a0@r1": 1, "acme/a1@r1": 1}
    assert record_key(bad) not in pager.cpu_cache
    assert pager.stats.load_errors == 1


def test_a_failed_load_is_retried_by_the_next_fetch(pager, catalog):
    record = pager.resolve("acme/a2")
    stored = catalog.catalog.read_blob(record)
    corrupt(catalog, record)
    with pytest.raises(CorruptBlob):
        pager.fetch(record).result(WAIT)
    shard = catalog.catalog.shard(catalog.catalog.shard_index(record.adapter_id))
    shard.write(lambda txn, dbs: txn.put(record.ref.encode(), stored, db=dbs.blob))  # repaired
    assert pager.fetch(record).result(WAIT).rank == 1
    assert catalog.reads == {"acme/a2@r1": 2} and pager.stats.in_flight == 0


def test_blob_for_another_base_is_refused_after_the_read(pager):
    foreign = dataclasses.replace(pager.catalog.catalog.resolve("other/x"), base_fingerprint=FINGERPRINT)
    with pytest.raises(BaseMismatch, match="fp-other-base"):
        pager.fetch(foreign).result(WAIT)
    assert record_key(foreign) not in pager.cpu_cache


def test_a_load_in_flight_is_shared_then_cached(pager, catalog):
    record = pager.resolve("acme/a1")
    catalog.gate.clear()
    pager.fetch(record)
    pager.fetch(record)
    waiting = pager.fetch(record)
    assert pager.stats.in_flight == 1
    catalog.gate.set()
    assert waiting.result(WAIT).rank == 4
    assert pager.fetch(record).done()  # already cached: nothing to load
    assert catalog.reads == {"acme/a1@r1": 1} and pager.stats.in_flight == 0


def test_closed_pager_refuses_fetches(catalog):
    pager = Pager(catalog, CpuCache(max_bytes=1 << 20), FINGERPRINT)
    record = pager.resolve("acme/a1")
    pager.close()
    with pytest.raises(RuntimeError, match="closed"):
        pager.fetch(record)
    with pytest.raises(ValueError, match="workers"):
        Pager(catalog, CpuCache(max_bytes=1), FINGERPRINT, workers=0)


def test_non_finite_revision_is_refused_at_page_in(catalog, pager) -> None:
    """A blob changed behind the validators' back (NaN in a tensor, checksum still right) is
    refused once, by the page-in, and never reaches the CPU cache; other revisions page in."""
    real_read = catalog.catalog.read_blobs

    def with_nan(blob):
        weights = load_revision(blob)
        name = next(iter(weights.tensors))
        weights.tensors[name] = torch.full_like(weights.tensors[name], float("nan"))
        return bytearray(save_revision(weights, check=False))

    def nan_read(records):
        return [with_nan(blob) if record.adapter_id == "acme/a1" else blob
                for record, blob in zip(records, real_read(records))]

    catalog.catalog.read_blobs = nan_read
    bad, good = pager.resolve("acme/a1"), pager.resolve("acme/a2")
    with pytest.raises(CorruptBlob, match="NaN or Inf"):
        pager.fetch(bad).result(WAIT)
    assert record_key(bad) not in pager.cpu_cache
    assert pager.fetch(good).result(WAIT) is not None
    assert record_key(good) in pager.cpu_cache


def test_wait_reads_returns_once_every_load_asked_for_is_read(catalog, pager):
    """`wait_reads` (the engine's short wait before a step): False while a read is still in
    flight, True once every load asked for has been read, its blob left for the owner to decode."""
    woken = threading.Event()
    pager.decode_on_owner(woken.set)
    assert pager.wait_reads(0)  # nothing asked for
    catalog.gate.clear()
    future = pager.fetch(pager.resolve("acme/a1"))
    assert not pager.wait_reads(0.01) and not future.done()
    catalog.gate.set()
    assert pager.wait_reads(WAIT) and woken.is_set() and not future.done()
    assert pager.finish_reads() == 1 and future.result(0).rank == 4


def test_a_carried_blob_is_decoded_by_the_owner_with_no_read(catalog, pager):
    """Issue 41: a blob read at the edge with its record (`Pager.fetch_carried`) is decoded and
    checked by the owner's next `finish_reads` as a blob read here is, and the catalog reads
    nothing; a carried blob that fails the checks fails that revision alone."""
    pager.decode_on_owner(lambda: None)
    record = pager.resolve("acme/a1")
    blob = catalog.catalog.read_blob(record)
    future = pager.fetch_carried(record, blob)
    assert future is not None and not future.done()
    assert pager.fetch_carried(record, blob) is None  # in flight: a second one joins by `fetch`
    assert pager.finish_reads() == 1
    expected, got = load_revision(bytearray(blob)), future.result(0)
    assert got.rank == 4 and got.tensors.keys() == expected.tensors.keys()
    assert all(torch.equal(got.tensors[name], t) for name, t in expected.tensors.items())
    assert catalog.reads == {} and pager.stats.blobs_carried == 1 and pager.stats.disk_reads == 0
    assert record_key(record) in pager.cpu_cache
    assert pager.fetch_carried(record, blob) is None  # cached: `fetch` hits the CPU tier

    bad = pager.resolve("acme/a2")
    nan = bytearray(catalog.catalog.read_blob(bad))
    nan[-4:] = bytes.fromhex("0000c07f")  # the last float32 value: NaN (same length)
    failing = pager.fetch_carried(bad, bytes(nan))
    pager.finish_reads()
    with pytest.raises(CorruptBlob, match="NaN or Inf"):
        failing.result(0)
    assert record_key(bad) not in pager.cpu_cache and pager.stats.load_errors == 1


def test_a_carried_blob_the_pager_cannot_use_leaves_the_read_to_fetch(catalog, pager):
    """None, and nothing queued, when no owner decodes, when the blob is not the record's length,
    or when the record was exported for another base (`fetch` then refuses it as always)."""
    record = pager.resolve("acme/a1")
    blob = catalog.catalog.read_blob(record)
    assert pager.fetch_carried(record, blob) is None  # workers decode: no owner to hand it to
    pager.decode_on_owner(lambda: None)
    assert pager.fetch_carried(record, blob[:-1]) is None
    other = catalog.catalog.resolve("other/x")
    assert pager.fetch_carried(other, catalog.catalog.read_blob(other)) is None
    assert pager.stats.blobs_carried == 0 and pager.finish_reads() == 0
