"""Cold resolves of one event-loop turn read together (issue 29): `IsolatedCatalog.resolve_ahead`
fills the resolve cache in one exchange with the shard hosts, and `sourcing.ResolveAhead`
gathers a turn's cold refs into one such read. The answers are the ones each resolve gives
alone: the same records, the same errors, the same fault containment."""
from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest
import torch

from loraserve.adapters.limits import PoolLimits
from loraserve.catalog.errors import AdapterNotFound, RevisionNotFound, ShardUnavailable
from loraserve.catalog.isolated import IsolatedCatalog
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.store import Catalog
from loraserve.engine.client.sourcing import ResolveAhead, resolve
from loraserve.engine.client.warm_refs import WarmRefs
from loraserve.engine.directory import EVERYONE, AdapterDirectory
from loraserve.engine.types import EngineError

ADAPTERS = 12


def blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(2, 16, generator=g),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(16, 2, generator=g)}
    return save_revision(AdapterWeights("fp", 2, ["q_proj"], torch.float32, t, "test"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cat_dir = tmp_path_factory.mktemp("ahead") / "cat"
    with Catalog.create(cat_dir, shards=3) as cat:
        for i in range(ADAPTERS):
            cat.put_revision(f"acme/a{i}", blob(i))
        cat.put_revision("acme/a0", blob(100), promote=False)  # r2, not promoted
        cat.tag("acme/a0", "next", "r2")
    return cat_dir


@pytest.fixture
def iso(built, tmp_path):
    shutil.copytree(built, tmp_path / "cat")
    with IsolatedCatalog(tmp_path / "cat", hosts=2) as cat:
        yield cat


def test_resolve_ahead_fills_the_cache_with_the_records_a_resolve_reads(iso) -> None:
    refs = [(f"acme/a{i}", None) for i in range(ADAPTERS)] + [("acme/a0", "next"), ("acme/a0", "r1")]
    with Catalog.open(iso.path, readonly=True) as plain:
        expected = {ref: plain.resolve(*ref) for ref in refs}
    iso.resolve_ahead(refs)
    assert len(iso.resolved) == len(refs)
    for ref in refs:
        generation = iso.shard(iso.shard_index(ref[0])).generation()
        assert iso.resolved.get(ref, generation) == expected[ref] == iso.resolve(*ref)
    assert iso.resolve("acme/a0", "next").revision == "r2"


def test_bad_names_raise_nothing_ahead_and_the_same_errors_after(iso) -> None:
    iso.resolve_ahead([("acme/none", None), ("acme/a1", "r9"), ("Not Valid!", None), ("acme/a2", None)])
    assert len(iso.resolved) == 1  # acme/a2 alone
    with pytest.raises(AdapterNotFound):
        iso.resolve("acme/none")
    with pytest.raises(RevisionNotFound):
        iso.resolve("acme/a1", "r9")


def test_a_write_after_the_read_ahead_is_seen(iso) -> None:
    iso.resolve_ahead([("acme/a3", None)])
    assert iso.resolve("acme/a3").revision == "r1"
    iso.put_revision("acme/a3", blob(200))  # promoted: the shard's generation moves on
    assert iso.resolve("acme/a3").revision == "r2"


def test_an_unavailable_shard_is_left_to_the_request(iso) -> None:
    index = iso.shard_index("acme/a4")
    iso.quarantine(iso.shard(index), "test", None)
    iso.resolve_ahead([("acme/a4", None), ("acme/a5", None)])
    with pytest.raises(ShardUnavailable):
        iso.resolve("acme/a4")


def test_a_turns_cold_refs_are_read_in_one_exchange(iso, monkeypatch) -> None:
    calls: list[list] = []
    real = iso.resolve_ahead
    monkeypatch.setattr(iso, "resolve_ahead", lambda refs: (calls.append(list(refs)), real(refs))[1])
    fp = iso.resolve("acme/a0").base_fingerprint
    directory = AdapterDirectory("base", iso, fp, PoolLimits(8, ("q_proj",)))
    warm = WarmRefs()
    names = [f"acme/a{i}" for i in range(1, ADAPTERS)] + ["acme/a0@next", "acme/none"]

    async def run():
        got = await asyncio.gather(*[resolve(warm, directory, None, n, EVERYONE) for n in names],
                                   return_exceptions=True)
        again = await resolve(warm, directory, None, "acme/a1", EVERYONE)  # warm now: no read ahead
        return got, again

    got, again = asyncio.run(run())
    assert calls == [[(f"acme/a{i}", None) for i in range(1, ADAPTERS)] + [("acme/a0", "next"), ("acme/none", None)]]
    for name, answer in zip(names[:-1], got):
        assert answer.record == directory.resolve(name, EVERYONE).record
    assert got[-2].record.revision == "r2"
    assert isinstance(got[-1], EngineError) and got[-1].status == 404
    assert again.record.ref == "acme/a1@r1" and len(calls) == 1


def test_an_in_process_catalog_is_not_read_ahead(built) -> None:
    with Catalog.open(built, readonly=True) as plain:
        assert ResolveAhead.of(plain) is None and ResolveAhead.of(None) is None


def test_a_small_blob_is_read_with_its_record_and_taken_once(iso) -> None:
    """Issue 41: a cold request's blob comes with its record, in the same exchange; the request
    takes it to the engine, whose page-in then reads nothing. The bytes are the stored blob."""
    refs = [(f"acme/a{i}", None) for i in range(4)] + [("acme/a0", "next")]
    iso.resolve_ahead(refs[:1])  # nobody asked for blobs yet: records only
    assert iso.take_carried(iso.resolve(*refs[0])) is None and len(iso.carried) == 0
    iso.resolved.clear()
    take = iso.carry_blobs()
    assert take == iso.take_carried
    iso.resolve_ahead(refs)
    with Catalog.open(iso.path, readonly=True) as plain:
        for ref in refs:
            record = iso.resolve(*ref)
            assert iso.take_carried(record) == plain.read_blob(record)
            assert iso.take_carried(record) is None  # once: the next request's engine has it
    other = iso.resolve("acme/a5")  # resolved alone, not ahead: nothing read with it
    assert iso.take_carried(other) is None


def test_a_blob_too_large_or_failing_its_checks_is_not_carried(iso) -> None:
    iso.carry_blobs(10)
    iso.resolve_ahead([("acme/a6", None)])
    record = iso.resolve("acme/a6")
    assert iso.take_carried(record) is None and record.size > 10
    iso.carry_blobs()
    bad = bytearray(blob(7))
    bad[-1] ^= 1  # the right length, the wrong checksum
    record = iso.resolve("acme/a7")
    with Catalog.open(iso.path) as plain:
        plain.shard(iso.shard_index("acme/a7")).write(
            lambda txn, dbs: txn.put(record.ref.encode(), bytes(bad), db=dbs.blob))
    iso.resolved.clear()
    iso.resolve_ahead([("acme/a7", None)])
    assert iso.resolve("acme/a7") == record  # the record resolves; its read reports the blob
    assert iso.take_carried(record) is None


def test_a_carried_blob_is_only_its_own_records(iso) -> None:
    """Held by (adapter, revision) and checked against the record that takes it: a record of
    another checksum or size (a catalog rebuilt under the same names) takes nothing."""
    iso.carry_blobs()
    iso.resolve_ahead([("acme/a8", None)])
    record = iso.resolve("acme/a8")
    assert iso.take_carried(dataclasses.replace(record, checksum="0" * 32)) is None
    iso.resolve_ahead([("acme/a9", None)])
    record = iso.resolve("acme/a9")
    assert iso.take_carried(dataclasses.replace(record, size=record.size + 1)) is None


def test_the_blobs_held_are_bounded(iso) -> None:
    iso.carry_blobs()
    iso.carried.capacity = 3
    iso.resolve_ahead([(f"acme/a{i}", None) for i in range(ADAPTERS)])
    assert len(iso.carried) == 3


@pytest.mark.parametrize("carries", [True, False], ids=["core-transport", "ray-ingress"])
def test_only_a_client_whose_transport_takes_blobs_to_the_core_reads_them(iso, demo_dense, carries) -> None:
    """The engine client asks its catalog for blobs (`carry_blobs`) only when its transport hands
    an `Add`'s blob to the core's page-in; a Ray Serve ingress (`RayTransport.carries_blobs` is
    False), whose replicas page adapters in themselves, reads records only."""
    from loraserve.engine.client.frontend import EngineClient, Transport
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.snapshot import EngineSnapshot
    from loraserve.model.tiny import byte_level_tokenizer
    from loraserve.ray_serve.frontend import RayTransport
    from loraserve.tokenizer import Tokenizer

    class Local(Transport):
        carries_blobs = carries

        def __init__(self) -> None:
            self.cfg = EngineConfig(model_dir=str(demo_dense), max_batch_size=8, max_waiting=8)
            self.snapshot = EngineSnapshot()
            fp = iso.resolve("acme/a0").base_fingerprint
            self.directory = AdapterDirectory("base", iso, fp, PoolLimits(8, ("q_proj",)))

        def send(self, msg) -> None:
            raise AssertionError(msg)

    assert RayTransport.carries_blobs is False and Transport.carries_blobs is True
    client = EngineClient(Local(), Tokenizer(byte_level_tokenizer(), [], None))
    assert (client._carried is not None) == carries and (iso.carry_bytes > 0) == carries
    iso.resolve_ahead([("acme/a10", None)])
    assert (iso.take_carried(iso.resolve("acme/a10")) is not None) == carries
