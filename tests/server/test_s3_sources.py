"""Adapters fetched on a miss from a real S3-compatible server (moto's, started here), over HTTP.

A server with `--adapter-source s3://adapters/prod/{tenant}/{name}` and keys for two tenants:
a request for an adapter its catalog lacks is fetched, imported and served (the same tokens as
the same PEFT directory imported locally through /v1/load_lora_adapter); a key never causes a
fetch outside its tenants; a missing object is the standard 404, a bad adapter a 400 naming
why, a store that is down a 503 until it is back; concurrent misses fetch once; and
/v1/load_lora_adapter takes the source's URIs, refusing one that is not the named id's location.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .adapter_files import write_peft
from .live import LiveServer
from s3_testing import moto_s3

SOURCE = "s3://adapters/prod/{tenant}/{name}"
KEYS = {"acme": "k-acme", "beta": "k-beta", "root": "k-root", "acme-loader": "k-acme-loader"}


def keys_toml() -> str:
    sha = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in KEYS.items()}
    return (f'[keys.acme]\nsha256 = "{sha["acme"]}"\nrole = "user"\ntenants = ["acme"]\n\n'
            f'[keys.beta]\nsha256 = "{sha["beta"]}"\nrole = "user"\ntenants = ["beta"]\n\n'
            f'[keys.root]\nsha256 = "{sha["root"]}"\nrole = "admin"\n\n'
            f'[keys.acme-loader]\nsha256 = "{sha["acme-loader"]}"\nrole = "user"\ntenants = ["acme"]\nload = true\n')


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_dense) -> Iterator[tuple[httpx.Client, AsyncEngine, object]]:
    tmp = tmp_path_factory.mktemp("s3-sources")
    cat_dir, root = tmp / "catalog", tmp / "root"
    Catalog.create(cat_dir, shards=2).close()
    write_peft(root / "support", hf_dense, seed=3)
    write_peft(root / "rank32", hf_dense, r=32)
    keys = tmp / "keys.toml"
    keys.write_text(keys_toml())
    with moto_s3() as s3:
        s3.put_dir("adapters", "prod/acme/support", root / "support")
        s3.put_dir("adapters", "prod/acme/rank32", root / "rank32")
        for name in ("burst", "loaded", "flaky"):
            s3.put_dir("adapters", f"prod/acme/{name}", root / "support")
        s3.put_dir("adapters", "prod/beta/support", root / "support")
        engine = AsyncEngine.from_model_dir(
            str(hf_dense), catalog_dir=str(cat_dir), device="cpu", dtype="float32", max_model_len=64,
            max_batch_size=4, max_gpu_adapters=2, max_lora_rank=16, adapter_root=str(root),
            adapter_sources=[SOURCE])
        with LiveServer(build_app(engine, max_n=2, keys=keys)) as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            yield http, engine, s3


def complete(http: httpx.Client, model: str, key: str = "acme") -> httpx.Response:
    return http.post("/v1/completions", headers=auth(key),
                     json={"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0})


def test_a_miss_is_fetched_imported_and_served_as_a_local_import_is(served) -> None:
    http, engine, _ = served
    r = complete(http, "acme/support")
    assert r.status_code == 200, r.text
    rec = engine.catalog.catalog.resolve("acme/support")
    assert rec.source == "s3://adapters/prod/acme/support"
    local = http.post("/v1/load_lora_adapter", headers=auth("root"),
                      json={"lora_name": "acme/local-copy", "lora_path": "support"})
    assert local.status_code == 200, local.text
    same = complete(http, "acme/local-copy")
    assert same.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


def test_a_key_never_fetches_outside_its_tenants(served) -> None:
    http, engine, _ = served
    before = engine.sourcing.sources.fetches
    r = complete(http, "beta/support", key="acme")  # the object exists, in another tenant
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert engine.sourcing.sources.fetches == before
    assert complete(http, "beta/support", key="beta").status_code == 200


def test_missing_is_404_and_a_bad_adapter_is_400_naming_why(served) -> None:
    http, engine, _ = served
    r = complete(http, "acme/absent")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    bad = complete(http, "acme/rank32")
    assert bad.status_code == 400 and "rank 32" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "model"
    assert [p.adapter_id for p in engine.catalog.catalog.list(prefix="acme/rank32")] == []


def test_store_down_is_503_and_serving_resumes_when_it_is_back(served) -> None:
    http, _, s3 = served
    assert complete(http, "acme/support").status_code == 200  # held locally: unaffected
    s3.stop()
    try:
        down = complete(http, "acme/flaky")
        assert down.status_code == 503, down.text
        assert complete(http, "acme/support").status_code == 200
    finally:
        s3.start()
    assert complete(http, "acme/flaky").status_code == 200


def test_concurrent_misses_fetch_once(served) -> None:
    http, engine, _ = served
    before = engine.sourcing.sources.fetches
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: complete(http, "acme/burst").status_code, range(4)))
    assert codes == [200] * 4
    assert engine.sourcing.sources.fetches == before + 1
    assert len(engine.catalog.catalog.policy("acme/burst").revisions) == 1


def test_load_lora_adapter_takes_source_uris_inside_the_template_only(served) -> None:
    http, engine, _ = served

    def load(name: str, path: str, key: str = "acme-loader") -> httpx.Response:
        return http.post("/v1/load_lora_adapter", headers=auth(key), json={"lora_name": name, "lora_path": path})

    ok = load("acme/loaded", "s3://adapters/prod/acme/loaded")
    assert ok.status_code == 200, ok.text
    assert engine.catalog.catalog.resolve("acme/loaded").revision == ok.json()["revision"]
    other = load("acme/stolen", "s3://adapters/prod/beta/support")  # another tenant's object
    assert other.status_code == 403 and other.json()["error"]["param"] == "lora_path"
    outside = load("acme/x", "s3://elsewhere/acme/x")
    assert outside.status_code == 403
    missing = load("acme/nothing", "s3://adapters/prod/acme/nothing")
    assert missing.status_code == 404
    assert load("beta/support", "s3://adapters/prod/beta/support").status_code in (403, 404)


def test_the_flags_reach_the_engine_config_and_bad_templates_stop_the_start() -> None:
    from loraserve.catalog.errors import CatalogError
    from loraserve.cli import build_parser
    from loraserve.engine.config import EngineConfig
    args = build_parser().parse_args(["serve", "--adapter-source", SOURCE, "--adapter-source",
                                      "hf://{tenant}/{name}", "--catalog-store", "s3://catalog/prod"])
    assert args.adapter_sources == [SOURCE, "hf://{tenant}/{name}"]
    assert args.catalog_store == "s3://catalog/prod"
    for bad in (["s3://adapters/{name}"], ["gs://b/{tenant}/{name}"]):
        with pytest.raises(CatalogError):
            EngineConfig(model_dir="m", adapter_sources=bad)
    with pytest.raises(ValueError):
        EngineConfig(model_dir="m", catalog_store="/local/dir")


def test_the_fetched_adapter_decodes_as_transformers_and_peft_do(served, hf_dense) -> None:
    """Greedy tokens of the S3-fetched adapter over HTTP equal transformers + PEFT's on the same
    PEFT directory."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    http, engine, _ = served
    prompt = [3, 17, 29, 41, 5]
    r = http.post("/v1/completions", headers=auth("acme"),
                  json={"model": "acme/support", "prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    root = engine.config.adapter_root
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dense, dtype=torch.float32),
                                      f"{root}/support").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
    want = engine.tokenizer.decode(out[0, len(prompt):].tolist())
    assert r.json()["choices"][0]["text"] == want
