"""A blob that fails its checksum here is healed from the durable tier (issue 43: a corrupt blob
answered 500 `corrupt_blob` even when the object store held a good copy): re-fetched from the
real S3-compatible store (moto's), verified, rewritten, served, with a log line and a count;
with no good copy in the store, the named 500 `corrupt_blob` as before."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.importer import adapter_blob
from loraserve.catalog.store import Catalog
from loraserve.catalog.store_s3 import ObjectStore, StoreTier
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .adapter_files import write_peft
from .live import LiveServer
from s3_testing import blob_object, moto_s3

STORE = "s3://catalog/heal"


@pytest.fixture(scope="module")
def healing(tmp_path_factory, hf_dense) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("blob-heal")
    base = BaseInfo.from_dir(hf_dense)
    blobs = [adapter_blob(write_peft(tmp / "peft" / f"s{i}", hf_dense, seed=i), base) for i in range(2)]
    Catalog.create(tmp / "server", shards=2).close()
    with moto_s3() as s3:
        s3.client().create_bucket(Bucket="catalog")
        other = StoreTier(ObjectStore(STORE), Catalog.create(tmp / "other", shards=2))
        engine = AsyncEngine.from_model_dir(
            str(hf_dense), catalog_dir=str(tmp / "server"), device="cpu", dtype="float32",
            max_model_len=64, max_batch_size=4, max_gpu_adapters=2, max_lora_rank=16,
            catalog_store=STORE)
        with LiveServer(build_app(engine, max_n=2)) as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            yield {"http": http, "engine": engine, "other": other, "blobs": blobs,
                   "catalog_dir": tmp / "server"}
        other.close()
        other.catalog.close()


def _corrupt_here(catalog_dir, adapter_id: str) -> None:
    """Flip a byte of the local blob (its record and checksum stay), as a bad disk would."""
    with Catalog(catalog_dir) as cat:
        record = cat.resolve(adapter_id)
        shard = cat.shard(cat.shard_index(adapter_id))

        def flip(txn, dbs):
            blob = bytearray(txn.get(record.ref.encode(), db=dbs.blob))
            blob[-3] ^= 0xFF
            txn.put(record.ref.encode(), bytes(blob), db=dbs.blob)
        shard.write(flip)


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4,
                                              "temperature": 0})


def test_a_corrupt_blob_is_healed_from_the_store_and_served(healing, caplog) -> None:
    http, engine, other = healing["http"], healing["engine"], healing["other"]
    other.catalog.put_revision("acme/heal", healing["blobs"][0])  # published to the store
    engine.sourcing.tier.fault_in("acme/heal")  # held here, not yet paged in
    _corrupt_here(healing["catalog_dir"], "acme/heal")
    with Catalog(healing["catalog_dir"]) as cat, pytest.raises(Exception, match="checksum"):
        cat.read_blob(cat.resolve("acme/heal"))
    healer = engine.transport.engine.adapters.pager.healer
    before = healer.healed
    with caplog.at_level(logging.WARNING, logger="loraserve.catalog.store_heal"):
        r = _complete(http, "acme/heal")
    assert r.status_code == 200, r.text
    assert healer.healed == before + 1
    assert any("re-fetched from the store" in m for m in caplog.messages), caplog.messages
    with Catalog(healing["catalog_dir"]) as cat:  # rewritten: the local copy verifies again
        assert cat.read_blob(cat.resolve("acme/heal")) == healing["blobs"][0]
    metrics = http.get("/metrics").text
    assert any(line.startswith("loraserve_adapter_blobs_healed_total") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines()), [l for l in metrics.splitlines() if "healed" in l]


def test_without_a_good_copy_the_named_error_stands(healing) -> None:
    http, engine, other = healing["http"], healing["engine"], healing["other"]
    rec = other.catalog.put_revision("acme/lost", healing["blobs"][1])
    engine.sourcing.tier.fault_in("acme/lost")
    _corrupt_here(healing["catalog_dir"], "acme/lost")
    bad = bytearray(healing["blobs"][1])
    bad[-1] ^= 0xFF
    other.store.put(blob_object(other.store, "acme/lost", rec.revision), bytes(bad))
    r = _complete(http, "acme/lost")
    assert r.status_code == 500 and r.json()["error"]["code"] == "corrupt_blob", r.text
    assert engine.transport.engine.adapters.pager.healer.unhealed >= 1
