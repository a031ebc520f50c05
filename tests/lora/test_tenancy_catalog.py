"""Tenants over HTTP with the real engine and a catalog: a user key of tenant `t` samples, lists,
reads, loads, unloads, promotes and rolls back only inside `t`; another tenant's adapter gets the
very 404 of an id that does not exist; the catalog is unchanged by every refused action; every
control-plane action is one audit line (each test checks the lines of its own actions)."""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loraserve.catalog.aliases import record_alias
from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from server.live import LiveServer

KEYS = {"t-user": "k-t", "t-ops": "k-ops", "b-user": "k-b", "root": "k-root"}
# catalog aliases: b's names b/secret@r1, t's its t/qv-r4 (as MinT exports name checkpoints)
B_ALIAS = "tinker://run-b:train:0/sampler_weights/000080"
T_ALIAS = "tinker://run-t:train:0/sampler_weights/000010"


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
        cat.tag("b/secret", "prod", "r1")
        record_alias(cat, B_ALIAS, "b/secret", "r1")
        record_alias(cat, T_ALIAS, "t/qv-r4", cat.resolve("t/qv-r4").revision)
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
        return live[1].catalog.catalog.policy(adapter_id).to_dict()
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


# -- names: what a key may not see answers exactly as what does not exist (issue 22, row 9) -------
# Every route that looks a name up, with a user key of tenant t (with and without `load`): a name
# of tenant b's (its adapter, revisions, tag, alias, in every form a request may give it) gets the
# answer a name that names nothing gets, byte for byte but the echoed name.

_PART = st.text("abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=3, max_size=10)


def _absent_name(tenant: str) -> st.SearchStrategy[str]:
    """An adapter id of `tenant` that does not exist (names start with 'q', no real one does)."""
    return _PART.map(lambda part: f"{tenant}/q{part}")


# (tenant b's real name, a same-shaped name that names nothing): ids, @revision, @tag, aliases
_REVS = st.sampled_from([None, "r1", "prod", "r9"]) | _PART.map(lambda p: "v" + p)
_B_REF = _REVS.map(lambda rev: "b/secret" + ("" if rev is None else f"@{rev}"))


@st.composite
def _pairs(draw) -> tuple[str, str]:
    kind = draw(st.sampled_from(["ref", "alias"]))
    if kind == "alias":
        absent = "tinker://run-" + draw(_PART) + ":train:0/sampler_weights/" + draw(
            st.text("0123456789", min_size=1, max_size=6))
        return B_ALIAS, absent
    rev = draw(_REVS)
    tenant = draw(st.sampled_from(["t", "b", "qz" + draw(_PART)]))
    suffix = "" if rev is None else f"@{rev}"
    return "b/secret" + suffix, draw(_absent_name(tenant)) + suffix


def _form(form: str, name: str) -> str:
    """The name as a request gives it."""
    if form == "tinker" and "://" not in name:
        return "tinker://" + name
    if form == "case":  # another case is another name: ids and aliases are case-sensitive
        head, _, tail = name.rpartition("/")
        return f"{head}/{tail.swapcase()}"
    if form == "encoded":  # percent-encoded in the name itself (a path carries it encoded twice)
        return quote(name, safe="")
    return name


def _routes() -> dict[str, Callable[[httpx.Client, dict, str, str], httpx.Response]]:
    """Every route that looks a model or adapter up by name: (client, headers, name, how a
    path carries it: the characters quote() leaves) -> response."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}

    def gen(path: str, **extra: object):
        return lambda http, h, name, safe: http.post(path, headers=h, json={
            "model": name, "max_tokens": 2, **extra})

    def get(prefix: str, suffix: str = ""):
        return lambda http, h, name, safe: http.get(f"{prefix}/{quote(name, safe=safe)}{suffix}",
                                                    headers=h)

    def post(prefix: str, suffix: str, body: dict | None):
        return lambda http, h, name, safe: http.post(
            f"{prefix}/{quote(name, safe=safe)}{suffix}", headers=h, json=body)

    def body(path: str, field: str, **extra: object):
        return lambda http, h, name, safe: http.post(path, headers=h, json={field: name, **extra})

    messages = [{"role": "user", "content": "hi"}]
    return {
        "completions": gen("/v1/completions", prompt="hi"),
        "completions-stream": gen("/v1/completions", prompt=["hi", "ho"], stream=True),
        "chat": gen("/v1/chat/completions", messages=messages),
        "chat-stream": gen("/v1/chat/completions", messages=messages, stream=True, n=2),
        "oai-completions": gen("/oai/api/v1/completions", prompt="hi"),
        "oai-chat": gen("/oai/api/v1/chat/completions", messages=messages),
        "model": get("/v1/models"),
        "oai-model": get("/oai/api/v1/models"),
        "adapter": get("/v1/adapters"),
        "promote": post("/v1/adapters", "/promote", {"revision": "r1"}),
        "rollback": post("/v1/adapters", "/rollback", None),
        "unload": body("/v1/unload_lora_adapter", "lora_name"),
        "load": body("/v1/load_lora_adapter", "lora_name", lora_path="qv"),
        "tinker-session": body("/api/v1/create_sampling_session", "model_path"),
        "tinker-sample": body("/api/v1/asample", "model_path", prompt=prompt,
                              sampling_params={"max_tokens": 2}),
    }


ROUTES = _routes()


def _shape(r: httpx.Response, name: str) -> tuple[int, str, str]:
    """(status, the body with the echoed name cut out, the headers that matter)."""
    echoed = json.dumps(name)[1:-1]  # as it stands in the JSON text
    return r.status_code, r.text.replace(echoed, "<NAME>"), r.headers.get("content-type", "")


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pair=_pairs(), form=st.sampled_from(["plain", "tinker", "case", "encoded"]),
       safe=st.sampled_from(["/@:", ""]), key=st.sampled_from(["t-user", "t-ops"]))
@example(pair=(B_ALIAS, "tinker://run-q:train:0/sampler_weights/1"), form="plain", safe="/@:",
         key="t-ops")
@example(pair=("b/secret@prod", "t/qnothing@prod"), form="tinker", safe="", key="t-user")
@example(pair=("b/secret", "t/qnothing"), form="plain", safe="/@:", key="t-ops")
@example(pair=("b/secret@r1", "qzq/qnothing@r1"), form="plain", safe="/@:", key="t-ops")
def test_names_a_key_may_not_see_answer_as_names_that_do_not_exist(
        live, pair: tuple[str, str], form: str, safe: str, key: str) -> None:
    hidden, absent = (_form(form, name) for name in pair)
    with httpx.Client(base_url=live[0].url, timeout=60) as http:
        for route, call in ROUTES.items():
            if route == "load" and absent.split("/", 1)[0] == "t":
                continue  # loading into its own tenant makes the name: no lookup there
            got = call(http, as_(key), hidden, safe)
            want = call(http, as_(key), absent, safe)
            assert 400 <= got.status_code < 500, (route, hidden, got.text)
            assert _shape(got, hidden) == _shape(want, absent), (route, hidden, absent)
            # and nothing in it names what the name resolved to
            assert "secret" not in got.text.replace(json.dumps(hidden)[1:-1], ""), (route, got.text)


def test_after_the_names_every_tenant_is_served(live, http) -> None:
    """The lookups above changed nothing: both tenants sample their adapters, by id and alias."""
    assert policy(live, "b/secret")["tags"] == {"prod": "r1"}
    assert sample(http, "t-user", "t/qv-r4").status_code == 200
    assert sample(http, "t-user", T_ALIAS).status_code == 200
    assert sample(http, "b-user", B_ALIAS).status_code == 200
    assert sample(http, "b-user", "b/secret@prod").status_code == 200
    hidden = sample(http, "t-user", B_ALIAS)
    assert hidden.status_code == 404 and "secret" not in hidden.text
    assert hidden.json()["error"] == {
        "message": f"The model `{B_ALIAS}` does not exist.", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
