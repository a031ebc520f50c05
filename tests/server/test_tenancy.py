"""Tenants and keys over HTTP with the fake engine: what a user key may see and use, /metrics,
per-tenant limits (429) and counters, key reloads (route and SIGHUP) under a streaming request,
and the audit log of reloads."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.server import build_app
from loraserve.keys import KeyFileError, Limits, Principal, append_key
from loraserve.server.limits import LimitExceeded, Limiter

from .fake_engine import FakeEngine
from .live import LiveServer
from .test_auth_metrics_lifecycle import samples, wait_for

BASE = "fake-base"
KEYS = {"acme": "k-acme", "beta": "k-beta", "root": "k-root", "acme-slow": "k-slow",
        "gamma-one": "k-one"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_toml() -> str:
    return f"""
[keys.acme]
sha256 = "{sha('k-acme')}"
role = "user"
tenants = ["acme"]
weight = 2.5

[keys.beta]
sha256 = "{sha('k-beta')}"
role = "user"
tenants = ["beta"]

[keys.root]
sha256 = "{sha('k-root')}"
role = "admin"

[keys.acme-slow]
sha256 = "{sha('k-slow')}"
role = "user"
tenants = ["acme"]
requests_per_second = 0.2

[keys.gamma-one]
sha256 = "{sha('k-one')}"
role = "user"
tenants = ["gamma"]
max_concurrent = 1
"""


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def completion(model: str = BASE, **kw: object) -> dict:
    return {"model": model, "prompt": "ab", "max_tokens": 2, **kw}


@pytest.fixture()
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(keys_toml())
    return path


@pytest.fixture()
def served(tmp_path: Path, keys_file: Path) -> Iterator[tuple[httpx.Client, FakeEngine, Path]]:
    engine = FakeEngine(adapters=("acme/support", "beta/secret"), delay_s=0.0)
    audit = tmp_path / "audit.jsonl"
    app = build_app(engine, keys=keys_file, metrics_key="k-metrics", audit_log=audit)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        yield http, engine, audit


def test_a_user_key_uses_the_base_and_its_own_tenant_only(served) -> None:
    http, engine, _ = served
    r = http.post("/v1/completions", json=completion(), headers=auth("acme"))
    assert r.status_code == 200, r.text
    assert (engine.requests[-1].tenant, engine.requests[-1].tenant_weight) == ("acme", 2.5)
    r = http.post("/v1/completions", json=completion("acme/support"),
                  headers={"X-API-Key": KEYS["acme"]})
    assert r.status_code == 200 and engine.requests[-1].tenant == "acme"
    before = len(engine.requests)
    other = http.post("/v1/completions", json=completion("beta/secret"), headers=auth("acme"))
    absent = http.post("/v1/completions", json=completion("beta/nope"), headers=auth("acme"))
    assert other.status_code == absent.status_code == 404
    assert other.text.replace("secret", "nope") == absent.text
    assert len(engine.requests) == before  # the engine never saw them
    chat = http.post("/v1/chat/completions", headers=auth("acme"), json={
        "model": "beta/secret", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 404
    assert http.post("/v1/completions", json=completion("beta/secret"),
                     headers=auth("beta")).status_code == 200
    assert http.post("/v1/completions", json=completion("beta/secret"),
                     headers=auth("root")).status_code == 200


def test_listing_and_model_cards_show_only_the_keys_tenants(served) -> None:
    http, _, _ = served

    def ids(name: str) -> list[str]:
        return [m["id"] for m in http.get("/v1/models", headers=auth(name)).json()["data"]]

    assert ids("acme") == [BASE, "acme/support"]
    assert ids("beta") == [BASE, "beta/secret"]
    assert ids("root") == [BASE, "acme/support", "beta/secret"]
    assert http.get("/v1/models/acme/support", headers=auth("acme")).status_code == 200
    other = http.get("/v1/models/beta/secret", headers=auth("acme"))
    absent = http.get("/v1/models/beta/nope", headers=auth("acme"))
    assert other.status_code == absent.status_code == 404
    assert other.text.replace("secret", "nope") == absent.text
    assert http.get("/v1/models/beta/secret", headers=auth("root")).status_code == 200
    assert http.get(f"/v1/models/{BASE}", headers=auth("acme")).status_code == 200


def test_keys_are_required_and_checked(served) -> None:
    http, _, _ = served
    for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"},
                    {"Authorization": "k-acme"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.get("/v1/models", headers={"X-API-Key": "k-metrics"}).status_code == 401
    assert http.get("/health").status_code == 200


def test_metrics_need_an_admin_or_the_metrics_key(served) -> None:
    http, _, _ = served
    assert http.post("/v1/completions", json=completion("acme/support"),
                     headers=auth("acme")).status_code == 200
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.get("/metrics", headers=auth("acme")).status_code == 403
    assert http.get("/metrics", headers={"X-API-Key": "k-metrics"}).status_code == 200
    m = samples(http.get("/metrics", headers=auth("root")).text)
    assert m[("loraserve_tenant_requests_total", (("tenant", "acme"),))] == 1
    assert m[("loraserve_tenant_prompt_tokens_total", (("tenant", "acme"),))] == 2
    assert m[("loraserve_tenant_generation_tokens_total", (("tenant", "acme"),))] == 2
    labels = {dict(lbl).get("tenant") for (name, lbl) in m if name.startswith("loraserve_tenant")}
    assert labels == {"acme"}  # tenants only: no adapter ids, no key ids


def test_a_tenant_over_its_rate_gets_429_while_others_are_served(served) -> None:
    http, _, _ = served
    first = http.post("/v1/completions", json=completion(), headers=auth("acme-slow"))
    assert first.status_code == 200
    r = http.post("/v1/completions", json=completion("acme/support"), headers=auth("acme-slow"))
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "requests_per_second" in err["message"]
    assert http.post("/v1/completions", json=completion(), headers=auth("beta")).status_code == 200
    assert http.post("/v1/completions", json=completion(), headers=auth("acme")).status_code == 200
    m = samples(http.get("/metrics", headers=auth("root")).text)
    key = ("loraserve_tenant_rejections_total",
           (("reason", "requests_per_second"), ("tenant", "acme")))
    assert m[key] == 1


def test_max_concurrent_counts_sequences_until_the_response_ends(served) -> None:
    http, engine, _ = served
    engine.delay_s = 0.02
    with http.stream("POST", "/v1/completions", headers=auth("gamma-one"),
                     json=completion(max_tokens=40, stream=True)) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        busy = http.post("/v1/completions", json=completion(), headers=auth("gamma-one"))
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert "max_concurrent" in busy.json()["error"]["message"]
        assert http.post("/v1/completions", json=completion(),
                         headers=auth("acme")).status_code == 200
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
    two = http.post("/v1/completions", json=completion(n=2), headers=auth("gamma-one"))
    assert two.status_code == 429  # 2 sequences never fit in 1
    assert http.post("/v1/completions", json=completion(),
                     headers=auth("gamma-one")).status_code == 200


def test_reload_keys_swaps_them_without_dropping_a_stream(served, keys_file: Path) -> None:
    http, engine, audit = served
    engine.delay_s = 0.02
    assert http.post("/admin/reload-keys", headers=auth("acme")).status_code == 403
    assert http.post("/admin/reload-keys").status_code == 401
    with http.stream("POST", "/v1/completions", headers=auth("acme"),
                     json=completion(max_tokens=30, stream=True)) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        new_key = append_key(keys_file, Principal("acme-new", admin=False, tenants=("acme",)))
        assert http.get("/v1/models", headers={"X-API-Key": new_key}).status_code == 401
        r = http.post("/admin/reload-keys", headers=auth("root"))
        assert r.status_code == 200 and r.json()["keys"] == 6
        assert http.get("/v1/models", headers={"X-API-Key": new_key}).status_code == 200
        good = keys_file.read_text()
        keys_file.write_text(good + '\n[keys.broken]\nsha256 = "00"\nrole = "user"\n')
        bad = http.post("/admin/reload-keys", headers=auth("root"))
        assert bad.status_code == 400 and "64 hex digits" in bad.json()["error"]["message"]
        assert http.get("/v1/models", headers={"X-API-Key": new_key}).status_code == 200
        events = [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and '"error"' not in "".join(events)
    reloads = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(a["action"], a["key"], a["outcome"]) for a in reloads] == [
        ("reload-keys", "root", "ok"), ("reload-keys", "root", "failed")]
    assert "64 hex digits" in reloads[1]["error"] and reloads[1]["status"] == 400


def test_without_keys_everything_stays_open() -> None:
    engine = FakeEngine(adapters=("acme/support", "beta/secret"))
    with LiveServer(build_app(engine)) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        assert http.post("/v1/completions", json=completion("beta/secret")).status_code == 200
        assert engine.requests[-1].tenant == "beta"
        assert http.post("/v1/completions", json=completion()).status_code == 200
        assert engine.requests[-1].tenant == ""
        assert len(http.get("/v1/models").json()["data"]) == 3
        assert http.get("/metrics").status_code == 200
        r = http.post("/admin/reload-keys")
        assert r.status_code == 400 and "--keys" in r.json()["error"]["message"]


def test_the_api_key_alone_is_one_admin_key(tmp_path: Path) -> None:
    engine = FakeEngine(adapters=("acme/support", "beta/secret"))
    with LiveServer(build_app(engine, api_key="s3cret")) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        admin = {"X-API-Key": "s3cret"}
        assert len(http.get("/v1/models", headers=admin).json()["data"]) == 3
        assert http.post("/admin/reload-keys").status_code == 401
        assert http.post("/admin/reload-keys", headers=admin).status_code == 400  # no keys file


def test_a_bad_keys_file_stops_build_app(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[keys.a]\nsha256 = "xyz"\nrole = "user"\ntenants = ["a"]\n')
    with pytest.raises(KeyFileError, match="64 hex digits"):
        build_app(FakeEngine(), keys=path)


SERVER_SCRIPT = """
import sys
from server.fake_engine import FakeEngine
from loraserve.server import run_server
from loraserve.server.config import ServerConfig
run_server(FakeEngine(delay_s=0.03), ServerConfig(keys=sys.argv[1]), port=0, log_level="info")
"""


def test_sighup_reloads_keys_under_a_streaming_request(keys_file: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(keys_file)], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{_port(proc)}"
        drain = threading.Thread(target=proc.stderr.read, daemon=True)  # keep the pipe flowing
        drain.start()
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", headers=auth("acme"),
                             json=completion(max_tokens=60, stream=True)) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                new_key = append_key(keys_file, Principal("late", admin=False, tenants=("x",)))
                assert http.get("/v1/models", headers={"X-API-Key": new_key}).status_code == 401
                proc.send_signal(signal.SIGHUP)
                assert wait_for(lambda: http.get("/v1/models", headers={
                    "X-API-Key": new_key}).status_code == 200)
                events = [line for line in lines if line.startswith("data:")]
                assert events[-1] == "data: [DONE]" and '"error"' not in "".join(events)
                assert len(events) == 60  # the 59 deltas after the first, [DONE]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _port(proc: subprocess.Popen) -> int:
    log = []
    for line in proc.stderr:  # uvicorn logs where it listens
        log.append(line)
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if found:
            return int(found.group(1))
    raise AssertionError("".join(log))


# -- limits per tenant, across its keys (issue 22, row 11) -------------------------------------------

TENANT_KEYS = {"d1": "k-d1", "d2": "k-d2", "e1": "k-e1", "e2": "k-e2", "z-tight": "k-zt",
               "z-other": "k-zo", "t1": "k-t1", "i1": "k-i1", "beta": "k-beta"}


def tenant_keys_toml() -> str:
    def key(key_id: str, tenant: str, extra: str = "") -> str:
        return (f'[keys.{key_id}]\nsha256 = "{sha(TENANT_KEYS[key_id])}"\nrole = "user"\n'
                f'tenants = ["{tenant}"]\n{extra}\n')

    return ("[tenants.delta]\nmax_concurrent = 1\n\n"
            "[tenants.eps]\nrequests_per_second = 0.2\n\n"
            "[tenants.zeta]\nmax_concurrent = 4\n\n"
            "[tenants.theta]\ntokens_per_minute = 100\n\n"
            "[tenants.iota]\nweight = 4\n\n"
            + key("d1", "delta") + key("d2", "delta") + key("e1", "eps") + key("e2", "eps")
            + key("z-tight", "zeta", "max_concurrent = 1") + key("z-other", "zeta")
            + key("t1", "theta") + key("i1", "iota", "weight = 2") + key("beta", "beta"))


def as_key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[name]}"}


@pytest.fixture()
def tenants_served(tmp_path: Path) -> Iterator[tuple[httpx.Client, FakeEngine]]:
    path = tmp_path / "keys.toml"
    path.write_text(tenant_keys_toml())
    engine = FakeEngine(adapters=("delta/x", "beta/secret"), delay_s=0.0)
    with LiveServer(build_app(engine, keys=path)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        yield http, engine


def test_two_keys_of_a_tenant_share_its_concurrency(tenants_served) -> None:
    http, engine = tenants_served
    engine.delay_s = 0.02
    with http.stream("POST", "/v1/completions", headers=as_key("d1"),
                     json=completion("delta/x", max_tokens=40, stream=True)) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        for name in ("d2", "d1"):  # the tenant's one sequence is in flight, whichever key asks
            busy = http.post("/v1/completions", json=completion(), headers=as_key(name))
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
            message = busy.json()["error"]["message"]
            assert "max_concurrent" in message and "this tenant" in message
        assert http.post("/v1/completions", json=completion("beta/secret"),
                         headers=as_key("beta")).status_code == 200  # another tenant: served
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
    assert http.post("/v1/completions", json=completion(), headers=as_key("d2")).status_code == 200


def test_a_tenant_at_its_concurrency_may_send_again_once_it_has_read_an_answer(tenants_served) -> None:
    """The slot is free when the client has the whole answer ([DONE] of a stream, the body of
    a plain one), not some moment after: back-to-back requests of a max_concurrent = 1 tenant,
    alternating keys and stream/plain, are all served, and another tenant meanwhile too."""
    http, engine = tenants_served
    engine.delay_s = 0.001
    for i in range(30):
        key = as_key("d1" if i % 2 else "d2")
        if i % 3:
            with http.stream("POST", "/v1/completions", headers=key,
                             json=completion("delta/x", max_tokens=3, stream=True)) as stream:
                assert stream.status_code == 200
                assert [ln for ln in stream.iter_lines() if ln.startswith("data:")][-1] == "data: [DONE]"
        else:
            assert http.post("/v1/completions", json=completion(), headers=key).status_code == 200
    assert http.post("/v1/completions", json=completion("beta/secret"),
                     headers=as_key("beta")).status_code == 200


def test_leases_are_released_before_the_last_body_message_is_sent() -> None:
    """The rule the test above samples, made exact at the middleware: when the response's last
    body message reaches the transport, the request's sequences are already out of its
    tenant's count, streamed (chunks, then an empty last message) or not (one message)."""
    import asyncio

    from loraserve.server.limits import Lease, Usage
    from loraserve.server.tenancy import AuthMiddleware, _CURRENT

    class Caller:
        def caller(self, path, method, key):
            return Principal(key_id="p", admin=False, tenants=("delta",))

    usage = Usage(Limits(max_concurrent=1), None, None)

    async def app(scope, receive, send):
        usage.in_flight += 1
        _CURRENT.get().leases.append(Lease((usage,), 1))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for more in scope["bodies"]:
            await send({"type": "http.response.body", "body": b"x", "more_body": more})

    for bodies in ([False], [True, True, False]):
        seen = []

        async def send(message):
            if message["type"] == "http.response.body":
                seen.append((message.get("more_body", False), usage.in_flight))

        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": [],
                 "bodies": bodies}
        asyncio.run(AuthMiddleware(app, Caller())(scope, None, send))
        assert seen == [(m, 1 if m else 0) for m in bodies]


def test_two_keys_of_a_tenant_share_its_request_rate(tenants_served) -> None:
    http, _ = tenants_served
    assert http.post("/v1/completions", json=completion(), headers=as_key("e1")).status_code == 200
    r = http.post("/v1/completions", json=completion(), headers=as_key("e2"))
    assert r.status_code == 429 and "requests_per_second" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert http.post("/v1/completions", json=completion(), headers=as_key("beta")).status_code == 200


def test_a_keys_own_limit_is_tighter_than_its_tenants(tenants_served) -> None:
    http, engine = tenants_served
    engine.delay_s = 0.02
    with http.stream("POST", "/v1/completions", headers=as_key("z-tight"),
                     json=completion(max_tokens=40, stream=True)) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        busy = http.post("/v1/completions", json=completion(), headers=as_key("z-tight"))
        assert busy.status_code == 429 and "this key" in busy.json()["error"]["message"]
        # the tenant allows 4: its other key goes on (2 sequences: 1 + 2 <= 4)
        assert http.post("/v1/completions", json=completion(n=2),
                         headers=as_key("z-other")).status_code == 200
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"


def test_tokens_are_charged_as_computed(tenants_served) -> None:
    """tokens_per_minute = 100: a request is charged prompt + max_tokens (2 + 60) at admission,
    and gets back what it did not generate when it ends (a stop string after one token)."""
    http, engine = tenants_served
    first_token = engine.tokenizer.token_text(engine.token_at(GenerateRequest(
        "x", engine.tokenizer.encode("ab"), SamplingParams(max_tokens=60)), 0))
    early = completion(max_tokens=60, stop=[first_token])
    for _ in range(3):  # 3 x 62 > 100: only what was computed stays charged (3 each)
        r = http.post("/v1/completions", json=early, headers=as_key("t1"))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    full = http.post("/v1/completions", json=completion(max_tokens=60), headers=as_key("t1"))
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 60
    r = http.post("/v1/completions", json=early, headers=as_key("t1"))  # 100 - 9 - 62 < 62
    assert r.status_code == 429 and "tokens_per_minute" in r.json()["error"]["message"]


def test_the_tenants_weight_goes_to_the_scheduler(tenants_served) -> None:
    http, engine = tenants_served
    assert http.post("/v1/completions", json=completion(), headers=as_key("i1")).status_code == 200
    assert (engine.requests[-1].tenant, engine.requests[-1].tenant_weight) == ("iota", 4.0)
    assert http.post("/v1/completions", json=completion(), headers=as_key("beta")).status_code == 200
    assert (engine.requests[-1].tenant, engine.requests[-1].tenant_weight) == ("beta", 1.0)


@pytest.mark.parametrize("text, reason", [
    ("[tenants.a]\nmax_concurrent = 0\n", "max_concurrent must be >= 1"),
    ("[tenants.a]\nload = true\n", "unknown field 'load'"),
    ('[tenants."a/b"]\nweight = 1\n', "invalid tenant"),
    ('[tenants."*"]\nweight = 1\n', "invalid tenant"),
    ("[tenants.a]\nweight = -1\n", "weight must be"),
    ("tenants = 3\n", "'tenants' must be a table"),
])
def test_a_bad_tenant_table_stops_build_app(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=re.escape(reason)):
        build_app(FakeEngine(), keys=path)


def test_limiter_shares_a_tenants_limits_across_keys_and_gives_unused_tokens_back() -> None:
    now = [100.0]
    limiter = Limiter(lambda: now[0])
    tenant = Limits(max_concurrent=3, requests_per_second=10, tokens_per_minute=600)
    one, two = (Principal(k, admin=False, tenants=("a",)) for k in ("k1", "k2"))
    tight = Principal("k3", admin=False, tenants=("a",), limits=Limits(max_concurrent=1))
    first = limiter.admit(one, "a", 2, 100, tenant)
    with pytest.raises(LimitExceeded) as err:  # 2 + 2 > 3, whichever key
        limiter.admit(two, "a", 2, 100, tenant)
    assert err.value.limit == "max_concurrent" and "this tenant" in err.value.message
    third = limiter.admit(tight, "a", 1, 100, tenant)  # 3 of 3
    first.release()
    with pytest.raises(LimitExceeded) as err:  # the tenant has room, the key none
        limiter.admit(tight, "a", 1, 100, tenant)
    assert "this key" in err.value.message
    third.used = 10  # computed 10 of its 100 tokens
    third.release()
    third.release()  # once only
    # 600 - 100 (first: used unknown, nothing given back) - 10 = 490 left
    limiter.admit(two, "a", 1, 490, tenant).release()
    with pytest.raises(LimitExceeded) as err:
        limiter.admit(two, "a", 1, 1, tenant)
    assert err.value.limit == "tokens_per_minute"
    other = limiter.admit(two, "b", 3, 600, Limits(max_concurrent=3))  # another tenant
    other.release()
