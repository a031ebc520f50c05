"""`--catalog-store`: a server whose catalog is a cache of the durable tier, beside a second "host"
(a catalog joined to the same moto bucket prefix) that writes, over HTTP.

A revision the other host commits is faulted in by the server on the first request for it; a
promote there is followed by the server (its poll of the change log); an adapter the server
imports is published and the other host faults it in; a corrupt blob in the store is refused
and never cached.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import AdapterNotFound
from loraserve.catalog.importer import adapter_blob
from loraserve.catalog.store import Catalog
from loraserve.catalog.store_s3 import ObjectStore, StoreTier
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .adapter_files import write_peft
from .live import LiveServer
from s3_testing import blob_object, moto_s3

STORE = "s3://catalog/prod"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, hf_dense) -> Iterator[tuple[httpx.Client, AsyncEngine, StoreTier, list[bytes]]]:
    """(client, the server's engine, the other host's tier, three blobs over hf_dense)."""
    tmp = tmp_path_factory.mktemp("s3-store")
    base = BaseInfo.from_dir(hf_dense)
    blobs = [adapter_blob(write_peft(tmp / "peft" / f"s{i}", hf_dense, seed=i), base) for i in range(3)]
    write_peft(tmp / "root" / "local", hf_dense, seed=7)
    Catalog.create(tmp / "server", shards=2).close()
    with moto_s3() as s3:
        s3.client().create_bucket(Bucket="catalog")
        other = StoreTier(ObjectStore(STORE), Catalog.create(tmp / "other", shards=2))
        engine = AsyncEngine.from_model_dir(
            str(hf_dense), catalog_dir=str(tmp / "server"), device="cpu", dtype="float32", max_model_len=64,
            max_batch_size=4, max_gpu_adapters=2, max_lora_rank=16, adapter_root=str(tmp / "root"),
            catalog_store=STORE, adapter_sources=[str(tmp / "src" / "{tenant}" / "{name}")])
        with LiveServer(build_app(engine, max_n=2)) as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            yield http, engine, other, blobs, s3, tmp / "src"
        other.close()
        other.catalog.close()


def complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0})


def served_revision(engine: AsyncEngine, adapter_id: str) -> str:
    return engine.catalog.catalog.resolve(adapter_id).revision


def test_a_revision_written_elsewhere_faults_in_and_its_promotes_are_followed(hosts) -> None:
    http, engine, other, blobs, *_ = hosts
    r1 = other.catalog.put_revision("acme/a", blobs[0])
    with pytest.raises(AdapterNotFound):
        engine.catalog.catalog.resolve("acme/a")
    assert complete(http, "acme/a").status_code == 200
    assert engine.catalog.catalog.resolve("acme/a").checksum == r1.checksum
    r2 = other.catalog.put_revision("acme/a", blobs[1])  # promoted there: the server follows
    deadline = time.monotonic() + 60
    while served_revision(engine, "acme/a") != r2.revision:
        assert time.monotonic() < deadline, "the promote never reached the server"
        time.sleep(0.1)
    assert complete(http, f"acme/a@{r1.revision}").status_code == 200


def test_an_import_here_is_published_for_the_other_host(hosts) -> None:
    http, engine, other, *_ = hosts
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "acme/local", "lora_path": "local"})
    assert r.status_code == 200, r.text
    got = other.fault_in("acme/local")
    assert got.checksum == engine.catalog.catalog.resolve("acme/local").checksum


def test_a_corrupt_blob_in_the_store_is_refused_and_never_cached(hosts) -> None:
    http, engine, other, blobs, *_ = hosts
    rec = other.catalog.put_revision("acme/c", blobs[2])
    bad = bytearray(blobs[2])
    bad[-1] ^= 0xFF
    other.store.put(blob_object(other.store, "acme/c", rec.revision), bytes(bad))
    r = complete(http, "acme/c")
    assert r.status_code >= 500 and "checksum" in r.json()["error"]["message"]
    with pytest.raises(AdapterNotFound):
        engine.catalog.catalog.resolve("acme/c")


def test_store_down_falls_back_to_the_sources_and_the_poller_catches_up(hosts, hf_dense) -> None:
    """The store down: a held adapter serves on, a miss comes from the adapter sources (not a
    503; a miss no source has is the store's 503); the store back: the source's import is
    published and a promote made elsewhere reaches the server."""
    http, engine, other, blobs, s3, src = hosts
    write_peft(src / "acme" / "fallback", hf_dense, seed=11)
    r1 = other.catalog.put_revision("acme/held", blobs[0])
    other.catalog.put_revision("acme/held", blobs[1])
    assert complete(http, "acme/held").status_code == 200
    s3.stop()
    try:
        assert complete(http, "acme/held").status_code == 200
        assert complete(http, "acme/fallback").status_code == 200
        assert complete(http, "acme/nowhere").status_code == 503
    finally:
        s3.start()
    other.catalog.promote("acme/held", r1.revision)
    deadline = time.monotonic() + 60
    while served_revision(engine, "acme/held") != r1.revision or other.store.policy("acme/fallback") is None:
        assert time.monotonic() < deadline, "the server never caught up with the store"
        time.sleep(0.1)
    mine = engine.catalog.catalog.resolve("acme/fallback")
    assert other.fault_in("acme/fallback").checksum == mine.checksum


def test_concurrent_misses_fault_in_once(hosts) -> None:
    http, engine, other, blobs, *_ = hosts
    other.catalog.put_revision("acme/burst", blobs[1])
    before = engine.sourcing.fault_ins.started
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: complete(http, "acme/burst").status_code, range(4)))
    assert codes == [200] * 4
    assert engine.sourcing.fault_ins.started == before + 1


def test_a_promote_over_http_is_published(hosts) -> None:
    http, engine, other, blobs, *_ = hosts
    r1 = other.catalog.put_revision("acme/p", blobs[0])
    other.catalog.put_revision("acme/p", blobs[1])
    assert complete(http, "acme/p@r1").status_code == 200  # the server holds r1 (and follows r2)
    r = http.post("/v1/adapters/acme/p/promote", json={"revision": r1.revision})
    assert r.status_code == 200, r.text
    assert other.store.policy("acme/p").promoted == r1.revision


def test_a_load_by_uri_wins_over_the_store_and_is_numbered_after_its_revisions(hosts, hf_dense) -> None:
    """The store holds acme/named (r1, other bytes) and this server does not: loading the
    source's files by URI faults the store's revisions in first, so the import is r2, promoted
    and published, and the other host follows it."""
    http, engine, other, blobs, s3, src = hosts
    theirs = other.catalog.put_revision("acme/named", blobs[0])
    write_peft(src / "acme" / "named", hf_dense, seed=12)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "acme/named", "lora_path": f"file://{src}/acme/named"})
    assert r.status_code == 200, r.text
    mine = engine.catalog.catalog.resolve("acme/named")
    assert mine.revision == "r2" and mine.checksum != theirs.checksum
    other.poll()
    assert other.store.policy("acme/named").promoted == "r2"
    assert other.catalog.resolve("acme/named").checksum == mine.checksum
