"""Batched page-ins: many cold revisions read in one catalog call (one LMDB read transaction per
shard) and decoded into views of one copy must give exactly what single page-ins give, keep each
revision's failure its own, and keep the pager's single-flight."""
import dataclasses
import json
import queue
import threading
import time
from concurrent.futures import wait
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from adapter_fakes import FINGERPRINT, make_weights, tiny_specs

from loraserve.catalog.errors import BaseMismatch, CorruptBlob, FactorsTooLarge, ShardUnavailable
from loraserve.catalog.layout import load_revision, save_revision
from loraserve.catalog.safetensors_header import PREFIX
from loraserve.catalog.store import Catalog
from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.manager import AdapterManager, PageIns
from loraserve.adapters.pager import Pager, record_key

from server.adapter_files import restore, truncate

SPECS = tiny_specs()
WAIT = 30  # generous bound on waits so a broken pager fails instead of hanging
COUNT = 12


class BatchRecorder:
    """The real catalog, recording the refs of every `read_blobs` call; calls wait at `gate`
    while it is clear (`entered` says the first has begun), so fetches made meanwhile queue up."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def resolve(self, adapter_id, revision=None):
        return self.catalog.resolve(adapter_id, revision)

    def read_blobs(self, records):
        with self.lock:
            self.batches.append([r.ref for r in records])
        self.entered.set()
        assert self.gate.wait(WAIT)
        return self.catalog.read_blobs(records)


def expected(i: int) -> object:
    dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
    return make_weights(SPECS, 1 + i % 4, seed=100 + i, dtype=dtype)


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog.create(tmp_path / "catalog", shards=3)  # few shards: batches share transactions
    for i in range(COUNT):
        cat.put_revision(f"acme/b{i}", save_revision(expected(i)))
    yield cat
    cat.close()


def corrupt(catalog: Catalog, record) -> None:
    """Flip one byte of the stored blob's data (its record and checksum stay)."""
    shard = catalog.shard(catalog.shard_index(record.adapter_id))

    def flip(txn, dbs):
        blob = bytearray(txn.get(record.ref.encode(), db=dbs.blob))
        blob[-3] ^= 0xFF
        txn.put(record.ref.encode(), bytes(blob), db=dbs.blob)

    shard.write(flip)


def queue_behind_first(pager: Pager, recorder: BatchRecorder, records: list) -> list:
    """Fetch records[0], hold its read, fetch the rest (they queue), release: the rest come in
    one batch. Returns the futures in record order."""
    recorder.gate.clear()
    futures = [pager.fetch(records[0])]
    assert recorder.entered.wait(WAIT)
    futures += [pager.fetch(r) for r in records[1:]]
    recorder.gate.set()
    return futures


def test_read_blobs_equals_read_blob_and_fails_per_entry(catalog, tmp_path):
    records = [catalog.resolve(f"acme/b{i}") for i in range(COUNT)]
    corrupt(catalog, records[4])
    missing = dataclasses.replace(records[5], revision="r9")
    truncated = dataclasses.replace(records[6], size=records[6].size + 1)
    asked = records + [missing, truncated]
    out = catalog.read_blobs(asked)
    assert len(out) == len(asked)
    for i, (record, got) in enumerate(zip(asked, out)):
        if i in (4, COUNT, COUNT + 1):
            with pytest.raises(CorruptBlob, match={4: "checksum", COUNT: "missing", COUNT + 1: "truncated"}[i]):
                catalog.read_blob(record)
            assert isinstance(got, CorruptBlob) and record.ref in str(got)
        else:
            assert isinstance(got, bytearray) and got == catalog.read_blob(record)


def test_read_blobs_an_unavailable_shard_fails_only_its_records(catalog):
    records = [catalog.resolve(f"acme/b{i}") for i in range(COUNT)]
    assert all(isinstance(b, bytearray) for b in catalog.read_blobs(records))  # every env mapped
    down = catalog.shard_index(records[0].adapter_id)
    data = catalog.path / f"shard-{down:03d}" / "data.mdb"
    old = truncate(data, 8192)
    try:
        out = catalog.read_blobs(records)
    finally:
        restore(data, old)
    for record, got in zip(records, out):
        if catalog.shard_index(record.adapter_id) == down:
            assert isinstance(got, ShardUnavailable) and got.shards == [down]
        else:
            assert got == catalog.read_blob(record)


@pytest.mark.parametrize("batch", [16, 4])
def test_batched_page_in_yields_the_tensors_of_single_page_ins(catalog, batch):
    records = [catalog.resolve(f"acme/b{i}") for i in range(COUNT)]
    recorder = BatchRecorder(catalog)
    with Pager(recorder, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=batch) as batched, \
            Pager(catalog, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=1) as single:
        together = [f.result(WAIT) for f in queue_behind_first(batched, recorder, records)]
        alone = [single.fetch(r).result(WAIT) for r in records]  # one at a time: batches of one
    assert [len(b) for b in recorder.batches] == [1] + [batch] * ((COUNT - 1) // batch) + \
        ([(COUNT - 1) % batch] if (COUNT - 1) % batch else [])
    for i, (record, a, b) in enumerate(zip(records, together, alone)):
        reference = load_revision(catalog.read_blob(record))  # the plain, unbatched decode
        for weights in (a, b, reference):
            assert (weights.rank, weights.targets, weights.dtype) == (expected(i).rank, expected(i).targets,
                                                                       expected(i).dtype)
            assert weights.tensors.keys() == expected(i).tensors.keys()
            assert all(torch.equal(weights.tensors[n], t) for n, t in expected(i).tensors.items())
            assert all(t.is_contiguous() for t in weights.tensors.values())
    assert batched.stats.disk_reads == COUNT and batched.stats.load_errors == 0


@pytest.mark.parametrize("owner_decodes", [False, True], ids=["worker-decodes", "owner-decodes"])
def test_a_bad_revision_in_a_batch_fails_only_its_own_future(catalog, owner_decodes):
    records = [catalog.resolve(f"acme/b{i}") for i in range(COUNT)]
    corrupt(catalog, records[3])
    catalog.put_revision("acme/foreign", save_revision(make_weights(SPECS, 2, fingerprint="fp-other")))
    foreign = dataclasses.replace(catalog.resolve("acme/foreign"), base_fingerprint=FINGERPRINT)
    nan = make_weights(SPECS, 2, seed=7)
    nan.tensors[next(iter(nan.tensors))][0, 0] = float("inf")
    catalog.put_revision("acme/inf", save_revision(nan, check=False))
    gone = dataclasses.replace(records[5], revision="r9")
    asked = [records[0], *records[1:3], records[3], foreign, records[4], catalog.resolve("acme/inf"), gone,
             *records[5:]]
    bad = {records[3].ref: (CorruptBlob, "checksum"), foreign.ref: (BaseMismatch, "fp-other"),
           "acme/inf@r1": (CorruptBlob, "NaN or Inf"), gone.ref: (CorruptBlob, "missing")}
    recorder = BatchRecorder(catalog)
    with Pager(recorder, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=32) as pager:
        if owner_decodes:
            pager.decode_on_owner(lambda: None)
        futures = queue_behind_first(pager, recorder, asked)
        for record, future in zip(asked, futures):
            if record.ref in bad:
                error, match = bad[record.ref]
                with pytest.raises(error, match=match):
                    pager.wait(future)
                assert record_key(record) not in pager.cpu_cache
            else:
                assert pager.wait(future).rank == record.rank
                assert record_key(record) in pager.cpu_cache
        assert len(recorder.batches) == 2 and set(recorder.batches[1]) >= {records[3].ref, gone.ref}
        stats = pager.stats
        assert (stats.disk_reads, stats.load_errors, stats.in_flight) == (len(asked), len(bad), 0)


def test_the_owner_decodes_what_the_workers_read(catalog):
    """`decode_on_owner`: a worker reads a batch and wakes the owner; nothing is decoded, cached
    or completed until the owner calls `finish_reads`, which completes every load of the batch
    on the owner's thread (their callbacks run there) with the tensors a worker would decode."""
    records = [catalog.resolve(f"acme/b{i}") for i in range(COUNT)]
    recorder = BatchRecorder(catalog)
    woken = threading.Semaphore(0)
    with Pager(recorder, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=32) as pager:
        pager.decode_on_owner(woken.release)
        futures = queue_behind_first(pager, recorder, records)
        callback_threads = []
        for f in futures:
            f.add_done_callback(lambda _: callback_threads.append(threading.current_thread()))
        assert woken.acquire(timeout=WAIT) and woken.acquire(timeout=WAIT)  # both batches read
        assert not any(f.done() for f in futures) and len(pager.cpu_cache) == 0
        assert pager.finish_reads() == COUNT and pager.finish_reads() == 0
        assert callback_threads == [threading.current_thread()] * COUNT
        for i, (record, f) in enumerate(zip(records, futures)):
            weights = f.result(0)
            assert all(torch.equal(weights.tensors[n], t) for n, t in expected(i).tensors.items())
            assert record_key(record) in pager.cpu_cache
        assert pager.stats.in_flight == 0

        # a blocking wait on the owner's own thread finishes the read itself (warm, pin)
        catalog.put_revision("acme/late", save_revision(expected(0)))
        late = pager.wait(pager.fetch(catalog.resolve("acme/late")))
        assert all(torch.equal(late.tensors[n], t) for n, t in expected(0).tensors.items())

        # close() decodes what was read and not yet finished: no future is left hanging
        catalog.put_revision("acme/last", save_revision(expected(1)))
        last = pager.fetch(catalog.resolve("acme/last"))
        assert woken.acquire(timeout=WAIT) and woken.acquire(timeout=WAIT) and not last.done()
    assert last.result(0).rank == expected(1).rank


def test_single_flight_holds_under_batching(catalog):
    records = [catalog.resolve(f"acme/b{i}") for i in range(4)]
    recorder = BatchRecorder(catalog)
    with Pager(recorder, CpuCache(1 << 24), FINGERPRINT, workers=2, batch=16) as pager:
        recorder.gate.clear()
        first = pager.fetch(records[0])
        assert recorder.entered.wait(WAIT)
        asks = [records[i % 4] for i in range(32)]  # eight fetches of each, from eight threads
        futures = [None] * len(asks)
        barrier = threading.Barrier(8)

        def ask(t):
            barrier.wait(WAIT)
            for i in range(t, len(asks), 8):
                futures[i] = pager.fetch(asks[i])

        threads = [threading.Thread(target=ask, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert pager.stats.in_flight == 4
        recorder.gate.set()
        results = {record_key(r): f.result(WAIT) for r, f in zip(asks, futures)}
        assert all(f.result(WAIT) is results[record_key(r)] for r, f in zip(asks, futures))
        assert first.result(WAIT) is results[record_key(records[0])]
        reads = [ref for batch in recorder.batches for ref in batch]
        assert sorted(reads) == sorted(r.ref for r in records)  # one read per revision, no more
        stats = pager.stats
        assert (stats.fetches, stats.disk_reads, stats.singleflight_joins) == (33, 4, 29)
        assert stats.in_flight == 0
        assert all(pager.fetch(r).done() for r in records) and pager.stats.cpu_hits == 4


def test_close_cancels_queued_loads_and_the_batch_setting_is_checked(catalog):
    records = [catalog.resolve(f"acme/b{i}") for i in range(3)]
    recorder = BatchRecorder(catalog)
    pager = Pager(recorder, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=1)
    recorder.gate.clear()
    running = pager.fetch(records[0])
    assert recorder.entered.wait(WAIT)
    queued = [pager.fetch(r) for r in records[1:]]
    closer = threading.Thread(target=pager.close)
    closer.start()
    wait(queued, WAIT)  # close() cancels what is queued, then waits for the running batch
    assert all(f.cancelled() for f in queued) and not running.done()
    recorder.gate.set()
    closer.join(WAIT)
    assert running.result(WAIT).rank == records[0].rank
    assert pager.stats.in_flight == 0 and len(recorder.batches) == 1
    with pytest.raises(ValueError, match="batch"):
        Pager(catalog, CpuCache(1), FINGERPRINT, batch=0)


def _reheadered(blob: bytes, edit) -> bytearray:
    """`blob` with its safetensors header JSON changed by `edit(header)` (data kept)."""
    (n,) = PREFIX.unpack(blob[:PREFIX.size])
    header = json.loads(blob[PREFIX.size:PREFIX.size + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-(PREFIX.size + len(text)) % 8)
    return bytearray(PREFIX.pack(len(text)) + text + blob[PREFIX.size + n:])


def _first_two(header):
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    return header[names[0]], header[names[1]]


def _shift(header, delta):
    _, second = _first_two(header)
    second["data_offsets"] = [second["data_offsets"][0] + delta, second["data_offsets"][1] + delta]


@pytest.mark.parametrize("edit, match", [
    (lambda h: _shift(h, 4), "gap or overlap"),
    (lambda h: _shift(h, -4), "gap or overlap"),
    (lambda h: _first_two(h)[0].update(shape=[9, 9]), "bytes for shape"),
    (lambda h: _first_two(h)[0].update(dtype="F16"), "differs from adapter dtype"),
    (lambda h: _first_two(h)[0].update(dtype="I8"), "differs from adapter dtype"),
    (lambda h: _first_two(h)[0].update(shape=[True, 8]), "non-negative integers"),
    (lambda h: _first_two(h)[0].pop("shape"), "malformed"),
])
def test_decoding_refuses_a_malformed_header(edit, match):
    """The page-in decoder (tensors as views of one copy) checks what safetensors would."""
    blob = save_revision(expected(0))
    with pytest.raises(CorruptBlob, match=match):
        load_revision(_reheadered(blob, edit), what="adapter acme/x@r1")
    with pytest.raises(CorruptBlob, match="bytes after the last tensor"):
        load_revision(blob + b"\0" * 4)


def test_decoded_tensors_share_the_one_buffer_and_check_finiteness_once():
    weights = expected(1)
    buf = bytearray(save_revision(weights))
    decoded = load_revision(buf, finite=True)
    assert all(torch.equal(decoded.tensors[n], t) for n, t in weights.tensors.items())
    first = next(iter(decoded.tensors.values()))
    first[0, 0] = float("nan")  # written through the view: it is buf's memory, not a copy
    with pytest.raises(CorruptBlob, match=rf"adapter acme/x@r1: tensor {next(iter(decoded.tensors))} holds NaN"):
        load_revision(buf, what="adapter acme/x@r1", finite=True)
    assert torch.isnan(load_revision(buf).tensors[next(iter(decoded.tensors))][0, 0])  # unchecked


def test_a_checked_layout_is_reused_and_decodes_what_the_full_check_decodes(monkeypatch):
    """The tensor table of a blob is checked in full once; later blobs with the same table, dtype,
    rank and targets reuse that check (`layout._LAYOUTS`) and decode to the same tensors, views
    of their own buffer. What differs per blob is still checked on the reused path: its length,
    its values, and metadata that the table's check depended on."""
    from loraserve.catalog import layout
    monkeypatch.setattr(layout, "_LAYOUTS", layout._LayoutCache())
    def want_of(i):
        return make_weights(SPECS, 2, seed=100 + i)
    blobs = [bytearray(save_revision(want_of(i))) for i in range(4)]
    full = load_revision(bytes(blobs[0]), finite=True)  # the one full check: the layout is kept
    assert len(layout._LAYOUTS) == 1
    for i, buf in enumerate(blobs):
        reused = load_revision(buf, finite=True)
        want = want_of(i)
        assert list(reused.tensors) == list(full.tensors)
        for name, t in reused.tensors.items():
            assert torch.equal(t, want.tensors[name]) and t.stride() == full.tensors[name].stride()
            assert t.untyped_storage().data_ptr() == reused.tensors[name].untyped_storage().data_ptr()
        assert (reused.rank, reused.targets, reused.dtype, reused.base_fingerprint, reused.source) == (
            want.rank, want.targets, want.dtype, want.base_fingerprint, want.source)
        assert reused.nbytes == want.nbytes
    assert len(layout._LAYOUTS) == 1  # one table, one entry
    next(iter(load_revision(blobs[2]).tensors.values()))[0, 0] = float("inf")
    with pytest.raises(CorruptBlob, match="holds NaN or Inf"):
        load_revision(blobs[2], finite=True)
    with pytest.raises(CorruptBlob, match="bytes after the last tensor"):
        load_revision(blobs[1] + b"\0" * 4)

    def meta(**changes):
        return lambda h: h["__metadata__"].update(changes)
    with pytest.raises(CorruptBlob, match="rank"):  # same table, another rank: checked afresh
        load_revision(_reheadered(bytes(blobs[3]), meta(rank="3")))
    fewer = ",".join(want_of(0).targets[1:])
    with pytest.raises(CorruptBlob, match="targets"):  # same table, fewer targets
        load_revision(_reheadered(bytes(blobs[3]), meta(targets=fewer)))
    monkeypatch.setattr(layout, "_LAYOUTS", layout._LayoutCache(capacity=2))  # bounded: least recently used out
    for r in (1, 2, 3):
        load_revision(save_revision(make_weights(SPECS, r, seed=r)))
    assert len(layout._LAYOUTS) == 2


def test_a_header_seen_before_is_not_parsed_again_and_the_rest_is_still_checked(monkeypatch):
    """`checked_region` keeps each header it parsed and checked under its bytes
    (`layout._HEADERS`): revisions of one layout have byte-identical headers, so a later blob's
    JSON is not parsed again. What the header cannot say is checked every time: the blob's
    length and its values; a header that differs by a byte is parsed and checked afresh."""
    from loraserve.catalog import layout
    monkeypatch.setattr(layout, "_HEADERS", layout.BoundedLRU(256))
    parsed = []
    read = layout.read_header
    monkeypatch.setattr(layout, "read_header", lambda blob, what: parsed.append(what) or read(blob, what))
    blobs = [bytearray(save_revision(make_weights(SPECS, 2, seed=200 + i))) for i in range(4)]
    first = layout.checked_region(blobs[0], what="a", compute_dtype="float32")
    assert set(parsed) == {"a"}  # (its table was new too: checked in full, parsed there again)
    parsed.clear()
    for i, buf in enumerate(blobs):
        meta, table, start = layout.checked_region(buf, what=f"b{i}", compute_dtype="float32")
        assert (meta, table, start) == first
        with pytest.raises(TypeError):
            meta["rank"] = 9  # shared by every blob with this header: read-only
    assert parsed == []  # each later blob's header was a hit
    with pytest.raises(CorruptBlob, match="bytes after the last tensor"):
        layout.checked_region(blobs[1] + b"\0" * 8, what="padded")
    with pytest.raises(CorruptBlob, match="truncated|bytes"):
        layout.checked_region(blobs[1][:-8], what="cut")
    bad = bytearray(blobs[2])
    next(iter(load_revision(bad).tensors.values()))[0, 0] = float("nan")
    with pytest.raises(CorruptBlob, match="holds NaN or Inf"):
        layout.checked_region(bad, what="nan", compute_dtype="float32")
    fewer = ",".join(make_weights(SPECS, 2, seed=0).targets[1:])
    other = _reheadered(bytes(blobs[3]), lambda h: h["__metadata__"].update(targets=fewer))
    with pytest.raises(CorruptBlob, match="targets"):  # new bytes: parsed and checked in full
        layout.checked_region(other, what="other")
    assert parsed[-1] == "other"
    monkeypatch.setattr(layout, "HEADER_CACHE_BYTES", 64)  # a header past the bound is not kept
    kept = len(layout._HEADERS)
    big = bytearray(save_revision(make_weights(SPECS, 3, seed=300)))
    for _ in range(2):
        layout.checked_region(big, what="big", compute_dtype="float32")
    assert len(layout._HEADERS) == kept and parsed.count("big") >= 2  # parsed each time


_CLEAN = bytes(save_revision(make_weights(SPECS, 2, seed=400)))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(_CLEAN) - 1), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.sampled_from([0, 0, 0, -8, -1, 8]))
def test_a_damaged_blob_is_judged_alike_with_its_header_cached_or_not(monkeypatch, edits, cut):
    """Generator: bytes of a blob overwritten anywhere (length prefix, header JSON, data) and its
    length cut or padded. `checked_region` accepts and refuses it exactly as with an empty
    header cache, whatever the cache holds (the clean blob's header, seen just before)."""
    from loraserve.catalog import layout
    blob = bytearray(_CLEAN)
    for at, value in edits:
        blob[at] = value
    blob = blob[:cut] if cut < 0 else blob + b"\0" * cut

    def judged(cache):
        monkeypatch.setattr(layout, "_HEADERS", cache)
        try:
            meta, table, start = layout.checked_region(bytearray(blob), what="x", compute_dtype="float32")
        except CorruptBlob:
            return "refused"
        return dict(meta), table, start

    cold = judged(layout.BoundedLRU(128))
    warm_cache = layout.BoundedLRU(128)
    monkeypatch.setattr(layout, "_HEADERS", warm_cache)
    layout.checked_region(bytearray(_CLEAN), what="clean", compute_dtype="float32")
    assert judged(warm_cache) == cold


def test_a_batch_of_page_ins_wakes_the_engine_thread_once(catalog):
    """The manager hands finished page-ins to the engine thread through `PageIns`: a batch of
    them wakes it once, not once each; after it has drained the queue, the next one wakes it
    again."""
    records = [catalog.resolve(f"acme/b{i}") for i in range(COUNT)]
    recorder = BatchRecorder(catalog)
    with Pager(recorder, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=32) as pager:
        pool = SimpleNamespace(config=SimpleNamespace(max_slots=4))  # fetch() uses no pool
        manager = AdapterManager(catalog, pool, pager.cpu_cache, pager, FINGERPRINT)
        wakes = []
        manager.notify = lambda: wakes.append(len(manager.page_ins))
        recorder.gate.clear()
        manager.fetch(records[0])
        assert recorder.entered.wait(WAIT)
        for record in records[1:]:
            manager.fetch(record)  # queued behind the first: the second batch
        recorder.gate.set()
        deadline = time.monotonic() + WAIT
        while len(manager.page_ins) < COUNT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert recorder.batches == [[records[0].ref], [r.ref for r in records[1:]]]
        assert wakes == [1]  # the first page-in woke it; the other 11 found it still to drain
        landed = []
        with pytest.raises(queue.Empty):
            while True:
                landed.append(manager.page_ins.get_nowait())
        assert sorted(key for key, _, _ in landed) == sorted(record_key(r) for r in records)
        assert all(err is None for _, _, err in landed)
        for key, weights, _ in landed:
            manager.settle(key, weights)
        manager.fetch(records[0])  # a CPU hit lands at once, and wakes the drained thread
        assert wakes == [1, 1]


def test_page_ins_lose_no_wake_up_between_threads():
    """Producers racing a consumer that drains whenever woken: every item is taken, and the
    consumer is never left asleep with items queued."""
    page_ins, woken, taken = PageIns(), threading.Event(), []
    producers, per = 4, 2000

    def produce(p: int) -> None:
        for i in range(per):
            if page_ins.put((p, i)):
                woken.set()

    def consume() -> None:
        while len(taken) < producers * per:
            assert woken.wait(WAIT), f"asleep with {len(page_ins)} items queued"
            woken.clear()
            while True:
                try:
                    taken.append(page_ins.get_nowait())
                except queue.Empty:
                    break

    consumer = threading.Thread(target=consume)
    consumer.start()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    consumer.join(WAIT)
    assert not consumer.is_alive()
    assert sorted(taken) == sorted((p, i) for p in range(producers) for i in range(per))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_check_reads_exponent_bits_of_every_serving_dtype(dtype, bad):
    """The page-in's finiteness check (numpy, on the raw bits: no torch op and so no OpenMP team
    on a pager thread) catches NaN and +-Inf in every serving dtype, names the tensor, and
    passes subnormals; the dtype's largest finite value is finite, but a factor holding it can
    overflow (`catalog.bounds`): refused too, naming the target."""
    weights = make_weights(SPECS, 2, seed=7, dtype=dtype)
    names = list(weights.tensors)
    edge = weights.tensors[names[0]]
    edge.view(-1)[1] = torch.finfo(dtype).tiny / 4  # subnormal
    assert load_revision(bytearray(save_revision(weights)), finite=True).tensors[names[0]].isfinite().all()
    edge.view(-1)[0] = torch.finfo(dtype).max
    with pytest.raises(FactorsTooLarge, match=names[0].rpartition(".")[0]):
        load_revision(bytearray(save_revision(weights, check=False)), finite=True)
    edge.view(-1)[0] = 0
    weights.tensors[names[-1]].view(-1)[-1] = bad
    with pytest.raises(CorruptBlob, match=rf"tensor {names[-1]} holds NaN or Inf"):
        load_revision(bytearray(save_revision(weights, check=False)), finite=True)
