"""Adapters over HTTP: the official openai client with adapter ids, residency and catalog
endpoints, runtime load/unload, metrics, and every documented failure followed by a good request."""
from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest

from loraserve.catalog.layout import load_revision, save_revision
from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from server.live import LiveServer


@pytest.fixture(scope="module")
def live(tmp_path_factory, dense_set) -> Iterator[tuple[LiveServer, AsyncEngine, object]]:
    root = tmp_path_factory.mktemp("served")
    cat_dir = root / "catalog"
    shutil.copytree(dense_set.catalog, cat_dir)
    with Catalog.open(cat_dir) as cat:  # plant a corrupt blob and a revision for another base
        rec = cat.resolve("t/qv-r4")
        weights = load_revision(cat.read_blob(rec))
        cat.put_revision("t/corrupt", save_revision(weights))
        bad = cat.resolve("t/corrupt")
        blob = bytearray(cat.read_blob(bad))
        blob[-1] ^= 0xFF
        cat.shard(cat.shard_index("t/corrupt")).write(
            lambda txn, dbs: txn.put(bad.ref.encode(), bytes(blob), db=dbs.blob))
        other = dataclasses.replace(weights, base_fingerprint="0" * 32)
        cat.put_revision("t/wrong-base", save_revision(other))
    adapter_root = root / "peft_root"
    adapter_root.mkdir()
    shutil.copytree(dense_set.peft_dirs["t/qv-r4"], adapter_root / "qv")
    engine = AsyncEngine.from_model_dir(str(dense_set.base), catalog_dir=str(cat_dir), device="cpu",
                                        dtype="float32", max_model_len=96, max_batch_size=8,
                                        max_gpu_adapters=2, max_lora_rank=16, adapter_root=str(adapter_root))
    with LiveServer(build_app(engine, max_n=4)) as server:
        yield server, engine, root


@pytest.fixture()
def http(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0].url, timeout=120) as c:
        yield c


def _good(http: httpx.Client, model: str = "t/qv-r4") -> dict:
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_with_adapter_ids(live) -> None:
    with openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        base = client.completions.create(model=live[1].model_name, prompt="hello", max_tokens=5, temperature=0)
        lora = client.completions.create(model="t/all-r8-rslora", prompt="hello", max_tokens=5, temperature=0)
        pinned = client.completions.create(model="t/all-r8-rslora@r1", prompt="hello", max_tokens=5, temperature=0)
        assert lora.choices[0].text == pinned.choices[0].text
        assert lora.choices[0].text != base.choices[0].text
        chat = client.chat.completions.create(model="t/o-head-r2", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "hi"}], stream=True)
        assert sum(len(c.choices[0].delta.content or "") for c in chat if c.choices) > 0


def test_models_and_adapter_residency(live, http) -> None:
    _good(http, "t/qv-r4")
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids[0] == live[1].model_name and "t/qv-r4" in ids
    page = http.get("/v1/models", params={"prefix": "t/", "limit": 2}).json()["data"]
    assert len(page) == 2 and all(m["id"].startswith("t/") for m in page)
    assert http.get("/v1/models/t/o-head-r2").status_code == 200
    assert http.get("/v1/models/t/nope").status_code == 404
    assert http.get("/v1/models/t/x@").status_code in (400, 404)
    info = http.get("/v1/adapters/t/qv-r4").json()
    assert info["promoted"] == "r1" and info["residency"] in ("gpu", "cpu")
    assert info["revisions"][0]["residency"] == info["residency"]
    assert http.get("/v1/adapters/t/nope").status_code == 404


@pytest.mark.parametrize("model, status", [
    ("t/nope", 404), ("t/qv-r4@r9", 404), ("bad id/../x", 404), ("t/wrong-base", 409), ("t/corrupt", 500),
    ("t/x@", 404),
])
def test_adapter_failures_then_still_serving(http, model, status) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "code" in err
    _good(http)


def test_load_and_unload_lora_adapter(live, http) -> None:
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "rt/qv", "lora_path": "does-not-exist"})
    assert missing.status_code == 404, missing.text
    outside = http.post("/v1/load_lora_adapter", json={"lora_name": "rt/qv", "lora_path": str(live[2])})
    assert outside.status_code == 403, outside.text
    escape = http.post("/v1/load_lora_adapter", json={"lora_name": "rt/qv", "lora_path": "../catalog"})
    assert escape.status_code == 403
    ok = http.post("/v1/load_lora_adapter", json={"lora_name": "rt/qv", "lora_path": "qv"})
    assert ok.status_code == 200, ok.text
    assert http.get("/v1/adapters/rt/qv").json()["residency"] in ("cpu", "gpu")
    assert _good(http, "rt/qv")["choices"][0]["text"] == _good(http, "t/qv-r4")["choices"][0]["text"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rt/qv"}).status_code == 200
    assert http.get("/v1/adapters/rt/qv").json()["residency"] == "disk"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rt/none"}).status_code == 404
    _good(http)


def test_adapter_metrics(http) -> None:
    _good(http)
    text = http.get("/metrics").text
    for name in ("loraserve_adapter_hits_total", "loraserve_adapter_misses_total",
                 "loraserve_adapter_evictions_total", "loraserve_adapter_resident", "loraserve_adapter_resident_bytes",
                 "loraserve_adapter_page_in_seconds_bucket", "loraserve_parked_requests", "vllm:lora_requests_info"):
        assert name in text, name
    assert 'tier="gpu"' in text and 'tier="cpu"' in text and 'max_lora="2"' in text


def test_loadtest_against_the_live_server(live) -> None:
    from loraserve.loadtest import LoadTestConfig, run_loadtest

    report = run_loadtest(LoadTestConfig(url=live[0].url, adapters=["t/qv-r4", "t/all-r8-rslora", "t/o-head-r2"],
                                         concurrency=3, max_requests=9, duration=120, prompt_len=3, max_tokens=3,
                                         progress=False, dist="zipf:1.1"))
    assert report["ok"] == 9 and report["errors"] == 0
    assert report["ttft_s"]["p50"] is not None and report["output_tokens"] == 27
    rates = report["adapter_hit_rate"]
    assert rates is not None and 0.0 <= rates["gpu"] <= 1.0


def _counters(http: httpx.Client) -> dict[str, float]:
    names = ("loraserve_adapter_blobs_carried_total", "loraserve_adapter_disk_reads_total")
    return {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
            if line.split(" ")[0] in names}


def test_a_cold_adapters_blob_comes_with_its_request(live, http) -> None:
    """Issue 41: the API side resolves a cold name with its blob (one shard-host exchange), and
    the request takes the blob to the engine, which reads nothing; the answer is the one the
    engine's own page-in gives (the same revision read again by the engine after an unload)."""
    with Catalog.open(live[2] / "catalog") as cat:
        cat.put_revision("t/carried", cat.read_blob(cat.resolve("t/qv-r4")))
    before = _counters(http)
    carried = _good(http, "t/carried")["choices"][0]["text"]
    after = _counters(http)
    assert after["loraserve_adapter_blobs_carried_total"] == before["loraserve_adapter_blobs_carried_total"] + 1
    assert after["loraserve_adapter_disk_reads_total"] == before["loraserve_adapter_disk_reads_total"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "t/carried"}).status_code == 200
    assert _good(http, "t/carried")["choices"][0]["text"] == carried == _good(http, "t/qv-r4")["choices"][0]["text"]
    again = _counters(http)  # resolved from the API's cache now: the engine read the blob itself
    assert again["loraserve_adapter_disk_reads_total"] == after["loraserve_adapter_disk_reads_total"] + 1
