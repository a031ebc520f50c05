"""POST /v1/load_lora_adapter is confined and bounded, and a refused import changes nothing.

Every hostile or broken import is answered at once with its own error (403 outside the root or
through a link leaving it, 400 for a FIFO, a malformed config, NaN weights, a rank the server
cannot serve, a NUL or lone surrogate; 413 over --max-adapter-mb), the catalog is exactly as
before, and an ordinary adapter request succeeds right after.
"""
from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loraserve.catalog.materialize import MaterializeConfig, materialize
from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app
from loraserve.server.adapter_routes import ImportRunner, import_adapter
from loraserve.server.errors import APIError

from .adapter_files import fill, poison, write_peft
from .live import LiveServer

SYNTH = "synth/a0000000"


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_dense) -> Iterator[tuple[httpx.Client, AsyncEngine, object, object]]:
    """(client, engine, catalog dir, adapter root) of a server with --max-lora-rank 16 and
    --max-adapter-mb 1, whose adapter root holds one directory per case."""
    tmp = tmp_path_factory.mktemp("imports")
    cat_dir, root = tmp / "catalog", tmp / "root"
    Catalog.create(cat_dir, shards=2).close()
    assert materialize(MaterializeConfig(cat_dir, hf_dense, 4, rank=2, workers=1, progress=False)).ok
    write_peft(root / "good", hf_dense)
    write_peft(root / "rank32", hf_dense, r=32)
    write_peft(root / "huge", hf_dense, r=1200)  # ~2 MiB of tensors
    write_peft(root / "nan", hf_dense)
    poison(root / "nan", math.nan)
    write_peft(root / "kv-1e19", hf_dense, targets=("q_proj", "k_proj", "v_proj"))
    fill(root / "kv-1e19", 1e19)  # finite, but K/V overflow: once poisoned every neighbour
    write_peft(root / "f16-max", hf_dense, targets=("q_proj", "v_proj", "o_proj"))
    fill(root / "f16-max", 65504.0, ("lora_",))
    write_peft(root / "no-r", hf_dense, config={"peft_type": "LORA", "lora_alpha": 8})
    write_peft(root / "bad-json", hf_dense)
    (root / "bad-json" / "adapter_config.json").write_text("{'r': 4}")
    for i in range(6):
        write_peft(root / f"fifo{i}", hf_dense)
        os.remove(root / f"fifo{i}" / "adapter_config.json")
        os.mkfifo(root / f"fifo{i}" / "adapter_config.json")
    os.symlink("/etc/passwd", root / "to-passwd")
    os.symlink("/no/such/dir", root / "to-nothing")
    engine = AsyncEngine.from_model_dir(str(hf_dense), catalog_dir=str(cat_dir), device="cpu", dtype="float32",
                                        max_model_len=64, max_batch_size=4, max_gpu_adapters=2,
                                        max_lora_rank=16, adapter_root=str(root), max_adapter_mb=1)
    with LiveServer(build_app(engine, max_n=2)) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        yield http, engine, cat_dir, root


def snapshot(engine) -> list[dict]:
    """Every policy record (ids, revisions, promotion, tags) as the server's catalog sees it."""
    return [p.to_dict() for p in engine.catalog.catalog.list(limit=1000)]


def load(http: httpx.Client, path: str, name: str = "rt/x") -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": SYNTH, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, status, words", [
    ("to-passwd", 403, "outside the allowed adapter root"),
    ("to-nothing", 403, "outside the allowed adapter root"),
    ("/etc", 403, "outside the allowed adapter root"),
    ("../catalog", 403, "outside the allowed adapter root"),
    ("missing", 404, "does not exist"),
    ("good/adapter_config.json", 400, "not a directory"),
    ("go\0od", 400, "NUL"),
    ("no-r", 400, "field 'r'"),
    ("bad-json", 400, "not valid JSON"),
    ("nan", 400, "contains NaN"),
    ("kv-1e19", 400, "can scale an activation by"),
    ("f16-max", 400, "can scale an activation by"),
    ("huge", 413, "import limit"),
    ("rank32", 400, "rank 32"),
])
def test_refused_import_is_contained(served, path, status, words) -> None:
    http, engine, _, _ = served
    before = snapshot(engine)
    r = load(http, path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == "lora_path", err
    assert "/etc/passwd" not in err["message"] and "/no/such" not in err["message"]  # targets never named
    assert snapshot(engine) == before  # nothing written, nothing promoted
    assert http.get("/v1/adapters/rt/x").status_code == 404
    still_serving(http)


def test_links_to_existing_and_missing_targets_read_the_same(served) -> None:
    http = served[0]
    a = load(http, "to-passwd").json()["error"]["message"].replace("to-passwd", "P")
    b = load(http, "to-nothing").json()["error"]["message"].replace("to-nothing", "P")
    assert a == b


def test_lone_surrogates_are_400(served) -> None:
    http, engine, _, _ = served
    before = snapshot(engine)
    for body in (b'{"lora_name": "rt/x", "lora_path": "good\\ud800"}',
                 b'{"lora_name": "rt/\\udc80x", "lora_path": "good"}'):
        r = http.post("/v1/load_lora_adapter", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    assert snapshot(engine) == before
    still_serving(http)


def test_six_concurrent_fifo_imports_fail_fast_and_wedge_nothing(served) -> None:
    http = served[0]
    start = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: load(http, f"fifo{i}", f"rt/fifo{i}"), range(6)))
    assert time.monotonic() - start < 30
    for r in answers:
        assert r.status_code == 400, r.text
        assert "adapter_config.json: not a regular file" in r.json()["error"]["message"]
    still_serving(http)
    assert load(http, "good", "rt/after-fifos").status_code == 200  # the import pool is free too


def test_good_import_after_all_refusals(served) -> None:
    http, engine, _, _ = served
    r = load(http, "good", "rt/good")
    assert r.status_code == 200, r.text
    assert r.json()["revision"] == "r1"
    out = http.post("/v1/completions", json={"model": "rt/good", "prompt": "hi", "max_tokens": 2})
    assert out.status_code == 200, out.text


def test_import_past_its_deadline_writes_nothing(served) -> None:
    engine = served[1]
    before = snapshot(engine)
    with pytest.raises(APIError) as e:
        import_adapter(engine, "rt/late", "good", deadline=time.monotonic() - 1)
    assert e.value.status == 504 and snapshot(engine) == before


def test_import_runner_bounds_time_and_queue() -> None:
    async def scenario() -> None:
        runner = ImportRunner(workers=1, deadline_s=0.3, max_pending=2)
        gate = threading.Event()
        start = time.monotonic()
        with pytest.raises(APIError) as late:
            await runner.run(lambda deadline: gate.wait(30))  # holds the one worker
        assert late.value.status == 504 and time.monotonic() - start < 5
        queued = asyncio.ensure_future(runner.run(lambda deadline: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as busy:  # one running + one queued = max_pending
            await runner.run(lambda deadline: "refused")
        assert busy.value.status == 503
        assert await asyncio.to_thread(lambda: "default pool") == "default pool"  # untouched meanwhile
        gate.set()
        assert await queued == "queued"
        assert await runner.run(lambda deadline: deadline > time.monotonic()) is True
        runner.close()

    asyncio.run(scenario())


def test_config_field_validation() -> None:
    from loraserve.engine.config import EngineConfig

    assert EngineConfig(model_dir="m").max_adapter_mb == 1024
    with pytest.raises(ValueError, match="max_adapter_mb"):
        EngineConfig(model_dir="m", max_adapter_mb=0)
