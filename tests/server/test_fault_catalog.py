"""A damaged or missing catalog file under a running server is its shard's problem.

A shard file truncated while the server runs (which used to end the process with SIGBUS on the
next read) makes that shard's adapters answer 503 catalog_unavailable while every other shard
and the base model serve on; /ready says which shards are down, /health stays 200, and the shard
serves again once its file is restored. A catalog directory removed under the server answers 503,
never a 404 that would claim the adapters do not exist; a write the OS refuses is a 503 too.
"""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from loraserve.catalog.materialize import MaterializeConfig, materialize
from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .adapter_files import restore, truncate
from .fake_engine import FakeEngine
from .live import LiveServer

SHARDS = 4
DEGRADED_GAUGE = "loraserve_catalog_shards_degraded"


@pytest.fixture
def served(tmp_path, hf_dense) -> Iterator[tuple[httpx.Client, AsyncEngine, object, dict[int, list[str]]]]:
    """A live server over a catalog of synthetic adapters in every shard; (client, engine, catalog
    dir, shard -> adapter ids)."""
    cat_dir = tmp_path / "catalog"
    Catalog.create(cat_dir, shards=SHARDS).close()
    assert materialize(MaterializeConfig(cat_dir, hf_dense, 24, rank=2, targets=["q_proj", "v_proj"],
                                         workers=1, progress=False)).ok
    with Catalog.open(cat_dir, readonly=True) as cat:
        by_shard: dict[int, list[str]] = {}
        for p in cat.list(limit=100):
            by_shard.setdefault(cat.shard_index(p.adapter_id), []).append(p.adapter_id)
    assert sorted(by_shard) == list(range(SHARDS)) and min(len(v) for v in by_shard.values()) >= 2
    engine = AsyncEngine.from_model_dir(str(hf_dense), catalog_dir=str(cat_dir), device="cpu", dtype="float32",
                                        max_model_len=64, max_batch_size=4, max_gpu_adapters=2, max_lora_rank=16)
    with LiveServer(build_app(engine, max_n=2)) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        yield http, engine, cat_dir, by_shard


def complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0})


def assert_unavailable(r: httpx.Response, shard: int | None = None) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "catalog_unavailable" and err["type"] == "server_error", err
    if shard is not None:
        assert f"shard {shard}" in err["message"], err


def gauge(http: httpx.Client) -> float:
    line = next(ln for ln in http.get("/metrics").text.splitlines() if ln.startswith(DEGRADED_GAUGE + " "))
    return float(line.split()[1])


def test_truncated_shard_fails_alone_and_the_server_lives(served) -> None:
    http, engine, cat_dir, by_shard = served
    bad = 2
    for ids in by_shard.values():  # every shard's env mapped, one adapter of each paged in
        assert complete(http, ids[0]).status_code == 200
    assert http.get("/ready").json() == {"status": "ready"} and gauge(http) == 0
    data = cat_dir / f"shard-{bad:03d}" / "data.mdb"
    old = truncate(data, 8192)  # the meta pages stay; every page of the tree is gone

    assert_unavailable(complete(http, by_shard[bad][0]), bad)  # resident, but its shard is down
    assert_unavailable(complete(http, by_shard[bad][1]), bad)  # never paged in
    assert_unavailable(http.get(f"/v1/adapters/{by_shard[bad][0]}"), bad)
    assert_unavailable(http.get("/v1/models", params={"prefix": "synth/", "limit": 100}), bad)  # not partial
    for s, ids in by_shard.items():
        if s != bad:
            assert complete(http, ids[0]).status_code == 200 and complete(http, ids[1]).status_code == 200
    assert complete(http, engine.model_name).status_code == 200
    ready = http.get("/ready")
    assert_unavailable(ready, bad)
    assert http.get("/health").status_code == 200 and gauge(http) == 1

    restore(data, old)  # same inode, same bytes: the shard serves again without a restart
    assert complete(http, by_shard[bad][1]).status_code == 200
    assert http.get("/ready").json() == {"status": "ready"} and gauge(http) == 0
    assert len(http.get("/v1/models", params={"prefix": "synth/", "limit": 100}).json()["data"]) == 24


def test_catalog_removed_under_the_server_is_503_not_404(served) -> None:
    http, engine, cat_dir, by_shard = served
    assert complete(http, by_shard[0][0]).status_code == 200  # shard 0 open, the others not
    shutil.rmtree(cat_dir)
    for ids in by_shard.values():
        assert_unavailable(complete(http, ids[0]))
        assert_unavailable(complete(http, ids[1]))
    assert_unavailable(complete(http, "synth/never-existed"))  # cannot tell: not a 404
    assert_unavailable(http.get("/v1/models", params={"prefix": "synth/"}))
    assert_unavailable(http.get("/ready"))
    assert http.get("/health").status_code == 200 and gauge(http) == SHARDS
    r = complete(http, engine.model_name)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert not cat_dir.exists()  # nothing re-created the directory


def test_ready_without_a_catalog() -> None:
    with LiveServer(build_app(FakeEngine(), max_n=2)) as server:
        r = httpx.get(f"{server.url}/ready", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_a_write_the_os_refuses_is_503_naming_the_shard(served) -> None:
    """The data file made immutable under the server (as a full or read-only disk would refuse
    the write): a promote answers 503 catalog_unavailable naming the shard, not 500; reads of
    the shard go on, and the promote succeeds once the file is writable again."""
    http, engine, cat_dir, by_shard = served
    shard, aid = 1, by_shard[1][0]
    catalog = engine.catalog.catalog
    catalog.put_revision(aid, catalog.read_blob(catalog.resolve(aid)), revision="again", promote=False)
    data = cat_dir / f"shard-{shard:03d}" / "data.mdb"
    if subprocess.run(["chattr", "+i", str(data)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a file system with it)")
    try:
        r = http.post(f"/v1/adapters/{aid}/promote", json={"revision": "again"})
        assert_unavailable(r, shard)
        assert "write refused" in r.json()["error"]["message"]
        assert complete(http, aid).status_code == 200 and http.get("/ready").status_code == 200
    finally:
        subprocess.run(["chattr", "-i", str(data)], check=True)
    r = http.post(f"/v1/adapters/{aid}/promote", json={"revision": "again"})
    assert r.status_code == 200 and r.json()["promoted"] == "again"
