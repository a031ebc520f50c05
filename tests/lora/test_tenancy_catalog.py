"""Tenants over HTTP with the real engine and a catalog: a user key of tenant `t` samples, lists,
reads, loads, unloads, promotes and rolls back only inside `t`; another tenant's adapter gets the
very 404 of an id that does not exist; the catalog is unchanged by every refused action; every
control-plane action is one audit line (each test checks the lines of its own actions)."""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from server.live import LiveServer

KEYS = {"t-user": "k-t", "t-ops": "k-ops", "b-user": "k-b", "root": "k-root"}


def _keys_toml() -> str:
    def sha(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    return (f'[keys.t-user]\nsha256 = "{sha("k-t")}"\nrole = "user"\ntenants = ["t"]\n'
            f'[keys.t-ops]\nsha256 = "{sha("k-ops")}"\nrole = "user"\ntenants = ["t"]\n'
            'load = true\n'
            f'[keys.b-user]\nsha256 = "{sha("k-b")}"\nrole = "user"\ntenants = ["b"]\n'
            f'[keys.root]\nsha256 = "{sha("k-root")}"\nrole = "admin"\n')


@pytest.fixture(scope="module")
def live(tmp_path_factory, dense_set) -> Iterator[tuple[LiveServer, AsyncEngine, Path]]:
    root = tmp_path_factory.mktemp("tenants")
    cat_dir = root / "catalog"
    shutil.copytree(dense_set.catalog, cat_dir)
    with Catalog.open(cat_dir) as cat:
        qv = cat.read_blob(cat.resolve("t/qv-r4"))
        wide = cat.read_blob(cat.resolve("t/all-r8-rslora"))
        cat.put_revision("b/secret", qv)
        cat.put_revision("t/multi", qv)    # r1
        cat.put_revision("t/multi", wide)  # r2, promoted; previous r1
    adapter_root = root / "peft_root"
    adapter_root.mkdir()
    shutil.copytree(dense_set.peft_dirs["t/qv-r4"], adapter_root / "qv")
    keys = root / "keys.toml"
    keys.write_text(_keys_toml())
    audit = root / "audit.jsonl"
    engine = AsyncEngine.from_model_dir(str(dense_set.base), catalog_dir=str(cat_dir), device="cpu",
                                        dtype="float32", max_model_len=96, max_batch_size=8,
                                        max_gpu_adapters=2, max_lora_rank=16,
                                        adapter_root=str(adapter_root))
    app = build_app(engine, max_n=4, keys=keys, metrics_key="k-metrics", audit_log=audit)
    with LiveServer(app) as server:
        yield server, engine, audit


@pytest.fixture()
def http(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0].url, timeout=120) as c:
        yield c


def as_(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def sample(http: httpx.Client, key: str, model: str) -> httpx.Response:
    return http.post("/v1/completions", headers=as_(key),
                     json={"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0})


def policy(live, adapter_id: str) -> dict | None:
    try:
        return live[1].adapter_manager.catalog.policy(adapter_id).to_dict()
    except Exception:
        return None


def audited(live) -> set[tuple]:
    """(key, action, adapter, revision, outcome) of every audit line so far. Each test checks
    the lines of its own actions: under xdist the module's tests may run on different workers,
    each with its own server and audit log."""
    lines = [json.loads(line) for line in live[2].read_text().splitlines()]
    assert all(set(a) >= {"time", "key", "action", "adapter", "revision", "outcome"} for a in lines)
    return {(a["key"], a["action"], a["adapter"], a["revision"], a["outcome"]) for a in lines}


def test_another_tenants_adapter_is_exactly_an_absent_one(http) -> None:
    assert sample(http, "t-user", "t/qv-r4").status_code == 200
    assert sample(http, "b-user", "b/secret").status_code == 200
    for ref in ("b/secret", "b/secret@r1"):
        hidden = sample(http, "t-user", ref)
        absent = sample(http, "root", ref.replace("secret", "nope"))  # truly absent
        assert hidden.status_code == absent.status_code == 404
        assert hidden.text.replace("secret", "nope") == absent.text
    for path in ("/v1/models/b/secret", "/v1/adapters/b/secret"):
        hidden = http.get(path, headers=as_("t-user"))
        absent = http.get(path.replace("secret", "nope"), headers=as_("root"))
        assert hidden.status_code == absent.status_code == 404
        assert hidden.text.replace("secret", "nope") == absent.text
    assert http.get("/v1/adapters/t/qv-r4", headers=as_("t-user")).status_code == 200
    assert http.get("/v1/adapters/b/secret", headers=as_("root")).status_code == 200
    # b's sample above left b/secret in the catalog's resolve cache: a hit changes nothing for
    # t (the 404 above), and both tenants are still served
    assert sample(http, "t-user", "b/secret").status_code == 404
    assert sample(http, "b-user", "b/secret").status_code == 200
    assert sample(http, "t-user", "t/qv-r4").status_code == 200


def test_listings_show_only_the_keys_tenants(live, http) -> None:
    def ids(key: str, **params: object) -> list[str]:
        r = http.get("/v1/models", headers=as_(key), params=params)
        assert r.status_code == 200, r.text
        return [m["id"] for m in r.json()["data"]]

    base = live[1].model_name
    mine = ids("t-user", prefix="")
    assert mine and all(i.startswith("t/") for i in mine) and "t/multi" in mine
    assert ids("t-user", prefix="b/") == [] and ids("t-user", prefix="b") == []
    assert ids("t-user", limit=2) == mine[:2]
    assert ids("root", prefix="b/") == ["b/secret"]
    assert "b/secret" in ids("root", prefix="")
    assert sample(http, "b-user", "b/secret").status_code == 200  # resident now
    assert "b/secret" in ids("root") and "b/secret" in ids("b-user")
    resident = ids("t-user")
    assert resident[0] == base and all(i == base or i.startswith("t/") for i in resident)


def test_loading_needs_load_and_stays_inside_the_tenant(live, http) -> None:
    body = {"lora_name": "t/fresh", "lora_path": "qv"}
    denied = http.post("/v1/load_lora_adapter", json=body, headers=as_("t-user"))
    assert denied.status_code == 403 and policy(live, "t/fresh") is None
    before = policy(live, "b/secret")
    for name in ("b/secret", "b/fresh"):  # over another tenant's adapter, or into its tenant
        r = http.post("/v1/load_lora_adapter", headers=as_("t-ops"),
                      json={"lora_name": name, "lora_path": "qv"})
        assert r.status_code == 403, r.text
    assert policy(live, "b/secret") == before and policy(live, "b/fresh") is None
    ok = http.post("/v1/load_lora_adapter", json=body, headers=as_("t-ops"))
    assert ok.status_code == 200, ok.text
    assert sample(http, "t-user", "t/fresh").status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "t/fresh"},
                     headers=as_("t-user")).status_code == 403
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "t/fresh"},
                     headers=as_("t-ops")).status_code == 200
    hidden = http.post("/v1/unload_lora_adapter", json={"lora_name": "b/secret"},
                       headers=as_("t-ops"))
    absent = http.post("/v1/unload_lora_adapter", json={"lora_name": "b/nope"},
                       headers=as_("root"))
    assert hidden.status_code == absent.status_code == 404
    assert hidden.text.replace("secret", "nope") == absent.text
    assert http.post("/v1/load_lora_adapter", headers=as_("root"),
                     json={"lora_name": "b/fresh", "lora_path": "qv"}).status_code == 200
    assert {("t-user", "load", "t/fresh", None, "denied"),
            ("t-ops", "load", "b/secret", None, "denied"),
            ("t-ops", "load", "t/fresh", "r1", "ok"),
            ("t-ops", "unload", "t/fresh", None, "ok"),
            ("t-ops", "unload", "b/secret", None, "denied")} <= audited(live)


def test_promote_and_rollback(live, http) -> None:
    def promoted(adapter_id: str) -> str:
        return http.get(f"/v1/adapters/{adapter_id}", headers=as_("root")).json()["promoted"]

    assert promoted("t/multi") == "r2"
    r = http.post("/v1/adapters/t/multi/promote", json={"revision": "r1"}, headers=as_("t-user"))
    assert r.status_code == 403 and promoted("t/multi") == "r2"
    r = http.post("/v1/adapters/t/multi/promote", json={"revision": "r1"}, headers=as_("t-ops"))
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "id": "t/multi", "revision": "r1", "promoted": "r1",
                        "previous": "r2"}
    pinned = sample(http, "t-user", "t/multi@r1").json()["choices"][0]["text"]
    assert sample(http, "t-user", "t/multi").json()["choices"][0]["text"] == pinned
    r = http.post("/v1/adapters/t/multi/rollback", headers=as_("t-ops"))
    assert r.status_code == 200 and r.json()["promoted"] == "r2" and promoted("t/multi") == "r2"
    assert http.post("/v1/adapters/t/multi/promote", json={"revision": "r9"},
                     headers=as_("t-ops")).status_code == 404
    before = policy(live, "b/secret")
    for path, body in (("promote", {"revision": "r1"}), ("rollback", None)):
        hidden = http.post(f"/v1/adapters/b/secret/{path}", json=body, headers=as_("t-ops"))
        absent = http.post(f"/v1/adapters/b/nope/{path}", json=body, headers=as_("root"))
        assert hidden.status_code == absent.status_code == 404
        assert hidden.text.replace("secret", "nope") == absent.text
    assert policy(live, "b/secret") == before
    assert http.post("/v1/adapters/b/secret/promote", json={"revision": "r1"},
                     headers=as_("root")).status_code == 200
    assert {("t-ops", "promote", "t/multi", "r1", "ok"),
            ("t-ops", "promote", "t/multi", "r9", "failed"),
            ("t-ops", "rollback", "t/multi", "r2", "ok"),
            ("root", "promote", "b/secret", "r1", "ok")} <= audited(live)


def test_metrics_and_the_audit_log(live, http) -> None:
    assert sample(http, "t-user", "t/qv-r4").status_code == 200
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=as_("t-user")).status_code == 403
    assert http.get("/metrics", headers={"X-API-Key": "k-metrics"}).status_code == 200
    text = http.get("/metrics", headers=as_("root")).text
    assert 'loraserve_tenant_requests_total{tenant="t"}' in text
    assert http.post("/admin/reload-keys", headers=as_("root")).status_code == 200
    assert ("root", "reload-keys", None, None, "ok") in audited(live)
