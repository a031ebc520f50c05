"""Adapter sources against real stores: moto's S3 server and a Hub-speaking HTTP server, both on
127.0.0.1, with boto3 and huggingface_hub as a user would configure them (environment only).

Each fetch imports the PEFT directory exactly as a local import does (the same blob bytes), keeps
its URI as the record's source, refuses a corrupt object by checksum with nothing written,
answers a missing one with SourceNotFound and a store that is down with SourceUnavailable (and
works again once it is back), fetches once for concurrent misses, and a template only yields
ids it was asked for.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import (AdapterNotFound, CatalogError, ExportError, SourceForbidden,
                                      SourceNotFound, SourceUnavailable)
from loraserve.catalog.fetchers import HubFetcher
from loraserve.catalog.importer import import_peft
from loraserve.catalog.layout import load_revision
from loraserve.catalog.sources import AdapterSources, Template, importer
from loraserve.catalog.store import Catalog

from hub_testing import HubServer
from s3_testing import moto_s3

S3 = "s3://adapters/prod/{tenant}/{name}"
MiB = 1 << 20


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory, dense_base):
    from catalog_fixtures import make_peft
    out, _ = make_peft(dense_base, tmp_path_factory.mktemp("peft") / "a", "qwen3", r=4, lora_alpha=8,
                       target_modules=["q_proj", "v_proj"])
    return out


@pytest.fixture(scope="module")
def s3(peft_dir):
    with moto_s3() as server:
        server.put_dir("adapters", "prod/acme/support", peft_dir)
        server.put_dir("adapters", "prod/globex/support", peft_dir)
        yield server


@pytest.fixture
def catalog(tmp_path):
    with Catalog.create(tmp_path / "cat", shards=2) as cat:
        yield cat


def fetch(sources, catalog, adapter_id, base_dir):
    base = BaseInfo.from_dir(base_dir)
    return sources.fetch(adapter_id, importer(catalog, adapter_id, base_dir, base))


def test_s3_fetch_imports_the_same_blob_as_a_local_import(s3, catalog, dense_base, peft_dir, tmp_path):
    sources = AdapterSources([S3], max_bytes=16 * MiB)
    rec = fetch(sources, catalog, "acme/support", dense_base)
    assert rec.source == "s3://adapters/prod/acme/support"
    assert catalog.resolve("acme/support") == rec
    again = sources.fetch("acme/support", importer(catalog, "acme/support", dense_base, BaseInfo.from_dir(dense_base)),
                          only=0)  # the same files again: the same revision (the header keeps the URI, not a temp dir)
    assert again.revision == rec.revision
    with Catalog.create(tmp_path / "local", shards=2) as local:
        ref = import_peft(local, "acme/support", peft_dir, dense_base)
    fetched, imported = (load_revision(bytearray(c.read_blob(r))) for c, r in ((catalog, rec), (local, ref)))
    assert fetched.tensors.keys() == imported.tensors.keys()
    assert all(torch.equal(fetched.tensors[k], imported.tensors[k]) for k in fetched.tensors)


def test_a_missing_adapter_is_not_found_and_remembered(s3, catalog, dense_base):
    sources = AdapterSources([S3], max_bytes=16 * MiB)
    with pytest.raises(SourceNotFound):
        fetch(sources, catalog, "acme/nothing", dense_base)
    with pytest.raises(SourceNotFound):  # within negative_ttl_s: no second store request
        fetch(sources, catalog, "acme/nothing", dense_base)
    assert sources.fetches == 1
    with pytest.raises(AdapterNotFound):
        catalog.resolve("acme/nothing")


def test_a_corrupt_object_is_refused_by_checksum_and_nothing_is_written(s3, catalog, dense_base, peft_dir):
    weights = (peft_dir / "adapter_model.safetensors").read_bytes()
    wrong = xxhash.xxh3_128_hexdigest(weights + b"x")
    s3.put_dir("adapters", "prod/acme/corrupt", peft_dir,
               metadata={"adapter_model.safetensors": {"xxh3-128": wrong}})
    sources = AdapterSources([S3], max_bytes=16 * MiB)
    with pytest.raises(ExportError, match="xxh3-128 checksum mismatch") as err:
        fetch(sources, catalog, "acme/corrupt", dense_base)
    assert err.value.status == 400 and wrong in str(err.value)
    with pytest.raises(AdapterNotFound):
        catalog.resolve("acme/corrupt")


def test_a_bad_adapter_is_a_400_naming_why(s3, catalog, dense_base, other_dense_base, tmp_path):
    from catalog_fixtures import make_peft
    other, _ = make_peft(other_dense_base, tmp_path / "other", "qwen3", r=4, lora_alpha=8,
                         target_modules=["q_proj"])
    s3.put_dir("adapters", "prod/acme/other-base", other)
    with pytest.raises(ExportError) as err:
        fetch(AdapterSources([S3], max_bytes=16 * MiB), catalog, "acme/other-base", dense_base)
    assert err.value.status == 400 and "q_proj" in str(err.value)


def test_too_large_is_refused_before_the_download(s3, catalog, dense_base):
    with pytest.raises(CatalogError) as err:
        fetch(AdapterSources([S3], max_bytes=1024), catalog, "acme/support", dense_base)
    assert err.value.status == 413


def test_store_down_is_unavailable_and_recovers(s3, catalog, dense_base):
    sources = AdapterSources([S3], max_bytes=16 * MiB, timeout_s=2.0)
    s3.stop()
    try:
        with pytest.raises(SourceUnavailable) as err:
            fetch(sources, catalog, "globex/support", dense_base)
        assert err.value.status == 503
    finally:
        s3.start()
    assert fetch(sources, catalog, "globex/support", dense_base).adapter_id == "globex/support"


def test_concurrent_misses_fetch_once(s3, catalog, dense_base):
    sources = AdapterSources([S3], max_bytes=16 * MiB)
    base = BaseInfo.from_dir(dense_base)
    gate = threading.Barrier(6)
    imports = []

    def into(peft_dir, uri):
        imports.append(uri)
        return importer(catalog, "acme/support", dense_base, base)(peft_dir, uri)

    def one(_):
        gate.wait()
        return sources.fetch("acme/support", into)

    with ThreadPoolExecutor(6) as pool:
        records = list(pool.map(one, range(6)))
    assert len(imports) == 1 and len({r.ref for r in records}) == 1
    assert sources.fetches <= 6 and len(catalog.policy("acme/support").revisions) == 1


def test_sources_are_tried_in_order(s3, catalog, dense_base, peft_dir, tmp_path):
    local = tmp_path / "local" / "acme" / "only-local"
    local.mkdir(parents=True)
    for f in peft_dir.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    sources = AdapterSources([S3, f"{tmp_path}/local/{{tenant}}/{{name}}"], max_bytes=16 * MiB)
    assert fetch(sources, catalog, "acme/support", dense_base).source.startswith("s3://")
    assert fetch(sources, catalog, "acme/only-local", dense_base).source == f"file://{local}"


def test_a_template_yields_only_the_id_it_was_asked_for():
    sources = AdapterSources([S3, "hf://org/{tenant}--{name}"], max_bytes=MiB,
                             fetchers={S3: object(), "hf://org/{tenant}--{name}": object()})
    assert sources.template_of("s3://adapters/prod/acme/x", "acme/x") == 0
    assert sources.template_of("hf://org/acme--x", "acme/x") == 1
    for uri, adapter_id in [("s3://adapters/prod/globex/x", "acme/x"),  # another tenant's object
                            ("s3://adapters/other/acme/x", "acme/x"),  # outside every template
                            ("s3://adapters/prod/acme/../globex/x", "acme/x"),
                            ("/etc/passwd", "acme/x")]:
        with pytest.raises(SourceForbidden):
            sources.template_of(uri, adapter_id)
    for bad in ["s3://b/{tenant}", "gs://b/{tenant}/{name}", "rel/{tenant}/{name}", "s3://b/{tenant}/{name}/{rev}"]:
        with pytest.raises(CatalogError):
            Template(bad)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, peft_dir):
    root = tmp_path_factory.mktemp("hub")
    for repo in ("acme/support", "acme/corrupt"):
        (root / repo).mkdir(parents=True)
        for f in peft_dir.iterdir():
            (root / repo / f.name).write_bytes(f.read_bytes())
    server = HubServer(root)
    data = (peft_dir / "adapter_model.safetensors").read_bytes()
    server.lie["acme/corrupt/adapter_model.safetensors"] = bytes([data[0] ^ 1]) + data[1:]
    yield server
    server.close()


def hub_sources(hub, tmp_path, monkeypatch) -> AdapterSources:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    fetcher = HubFetcher(timeout_s=5.0, cache_dir=str(tmp_path / "hf-cache"))
    return AdapterSources(["hf://{tenant}/{name}"], max_bytes=16 * MiB, fetchers={"hf://{tenant}/{name}": fetcher})


def test_hub_fetch_through_huggingface_hub(hub, catalog, dense_base, tmp_path, monkeypatch):
    sources = hub_sources(hub, tmp_path, monkeypatch)
    rec = fetch(sources, catalog, "acme/support", dense_base)
    assert rec.source == "hf://acme/support"
    assert any(r.startswith("GET /acme/support/resolve/main/adapter_model.safetensors") for r in hub.requests)
    with pytest.raises(SourceNotFound):
        fetch(sources, catalog, "acme/absent", dense_base)


def test_hub_corrupt_file_is_refused(hub, catalog, dense_base, tmp_path, monkeypatch):
    sources = hub_sources(hub, tmp_path, monkeypatch)
    with pytest.raises(ExportError, match="SHA-256 checksum mismatch"):
        fetch(sources, catalog, "acme/corrupt", dense_base)
    with pytest.raises(AdapterNotFound):
        catalog.resolve("acme/corrupt")


def test_hub_offline_serves_from_its_cache_and_checks_it(hub, dense_base, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE (read by huggingface_hub at import: set here on its constants): the cache
    `hf_hub_download` filled (as `huggingface-cli download` does; the Hub's layout: blobs named
    by ETag, snapshots linking to them) serves alone, each file checked against its blob name;
    an uncached repo is a 503, not a 404."""
    from huggingface_hub import constants, hf_hub_download
    hub_sources(hub, tmp_path, monkeypatch)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        hf_hub_download("acme/support", name, endpoint=hub.endpoint, cache_dir=str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(hub.requests)
    with Catalog.create(tmp_path / "offline", shards=2) as offline:
        offline_sources = hub_sources(hub, tmp_path, monkeypatch)
        assert fetch(offline_sources, offline, "acme/support", dense_base).source == "hf://acme/support"
        with pytest.raises(SourceUnavailable):
            fetch(offline_sources, offline, "acme/never-cached", dense_base)
        assert len(hub.requests) == asked
        blob = next((tmp_path / "hf-cache").glob("models--acme--support/blobs/*"))
        data = bytearray(blob.read_bytes())
        data[-1] ^= 1
        blob.write_bytes(bytes(data))
        with pytest.raises(ExportError, match="checksum mismatch"):
            fetch(hub_sources(hub, tmp_path, monkeypatch), offline, "acme/support", dense_base)
