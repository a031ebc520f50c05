"""Users' grammars cannot stall the server: each is parsed in a grammar worker process under a
deadline (a 400 naming the limit) and a per-tenant budget (429), so `/health` and another tenant
answer while pathological schemas convert (issue 43: a 450-deep schema froze /health 10.7 s).
A seeded grammar fuzzer (depth, breadth, patterns, refs) runs against the live server here; its
long run is bench/grammar_fuzz.py."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loraserve.server import build_app
from loraserve.server.grammar_checks import GrammarChecks
from .fake_engine import FakeEngine
from .live import LiveServer

DEADLINE_S = 1.5  # a 450-deep schema takes ~10 s here: past it on any CPU
RESPONSIVE_S = 2.5  # generous: /health and the other tenant answer within this


def deep_schema(depth: int, tag: str) -> dict[str, Any]:
    """Objects nested `depth` deep (xgrammar: ~10 s at 450 on the shared 2-core machine)."""
    schema: dict[str, Any] = {"type": "string", "description": tag}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def fuzz_schema(rng: random.Random) -> dict[str, Any]:
    """One generated schema: nesting depth, breadth, patterns and $refs, mixed."""
    kind = rng.choice(["deep", "broad", "patterns", "refs"])
    if kind == "deep":
        return deep_schema(rng.randint(50, 450), str(rng.random()))  # JSON encoders stop near 1000 levels
    if kind == "broad":
        n = rng.randint(50, 400)
        return {"type": "object", "properties": {f"p{i}": {"type": rng.choice(
            ["string", "integer", "boolean", "number"])} for i in range(n)},
            "required": [f"p{i}" for i in range(0, n, 2)]}
    if kind == "patterns":
        n = rng.randint(20, 400)
        return {"type": "object", "properties": {
            f"p{i}": {"type": "string", "pattern": "^(" + "|".join(
                f"[a-z]{{{rng.randint(1, 9)},{rng.randint(10, 40)}}}[0-9]+" for _ in range(3)) + ")$"}
            for i in range(n)}, "required": [f"p{i}" for i in range(n)]}
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(rng.randint(20, 300))}
    defs[f"d{len(defs)}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    app = build_app(FakeEngine(adapters=("acme/support", "beta/chat"), max_model_len=1 << 16))
    app.state.ctx.grammars = GrammarChecks(workers=2, deadline_s=DEADLINE_S, per_tenant=2)
    with LiveServer(app) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:  # workers up and warm
            assert _constrained(http, "beta/chat", {"type": "object"}).status_code == 200
        yield server


def _constrained(http: httpx.Client, model: str, schema: dict[str, Any]) -> httpx.Response:
    return http.post("/v1/completions", json={
        "model": model, "prompt": "x", "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})


class Watch:
    """Times /health and the other tenant (beta) in a loop while `attack` runs."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.stop = url, 0.0, threading.Event()
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(7)
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                health = http.get("/health")
                plain = http.post("/v1/completions", json={"model": "beta/chat", "prompt": "x",
                                                           "max_tokens": 2})
                small = _constrained(http, "beta/chat", {"type": "object", "properties": {
                    f"k{rng.randint(0, 10**9)}": {"type": "integer"}}})
                self.worst = max(self.worst, time.perf_counter() - t0)
                for r in (health, plain, small):
                    if r.status_code != 200:
                        self.failures.append(r.text)
                time.sleep(0.05)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def _attack(url: str, schemas: list[dict[str, Any]]) -> list[httpx.Response]:
    out: list[httpx.Response] = [None] * len(schemas)  # type: ignore[list-item]

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            out[i] = _constrained(http, "acme/support", schemas[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(schemas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_pathological_schemas_stall_no_one(live: LiveServer) -> None:
    schemas = [deep_schema(450, f"attack {i}") for i in range(4)]
    with Watch(live.url) as watch:
        answers = _attack(live.url, schemas)
    assert not watch.failures, watch.failures[:3]
    assert watch.worst < DEADLINE_S + RESPONSIVE_S, watch.worst
    codes = sorted(r.status_code for r in answers)
    assert set(codes) <= {400, 429} and 400 in codes, [r.text for r in answers]
    for r in answers:
        error = r.json()["error"]
        assert error["param"] == "response_format"
        if r.status_code == 400:  # the limit named
            assert f"within {DEADLINE_S:g} s" in error["message"], error
    grammars = live.server.config.app.state.ctx.grammars
    assert grammars.killed >= 1  # the conversion was ended, not left burning a core
    again = httpx.post(f"{live.url}/v1/completions", timeout=30, json={
        "model": "acme/support", "prompt": "x", "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schemas[0]}}})
    assert again.status_code in (400, 429)  # remembered: no worker spent on it again


def test_a_forced_tool_call_is_settled_off_the_loop(live: LiveServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep_schema(450, "t")}}]
    with Watch(live.url) as watch:
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=120, json={
            "model": "acme/support", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2, "tools": tools, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert not watch.failures and watch.worst < DEADLINE_S + RESPONSIVE_S, watch.worst


def test_grammar_fuzzer_keeps_others_served(live: LiveServer) -> None:
    """Seeded and bounded: generated schemas from two tenants' worth of requests at once."""
    rng = random.Random(43)
    schemas = [fuzz_schema(rng) for _ in range(8)]
    with Watch(live.url) as watch:
        answers = _attack(live.url, schemas)
    assert all(r is not None and r.status_code in (200, 400, 429) for r in answers), \
        [(r.status_code, r.text[:200]) for r in answers if r is not None]
    assert not watch.failures, watch.failures[:3]
    assert watch.worst < DEADLINE_S + RESPONSIVE_S, watch.worst


def test_a_tenant_past_its_grammar_budget_gets_a_429_and_others_do_not(live: LiveServer) -> None:
    """per_tenant slow grammars of acme in flight: one more of acme's is a 429 (Retry-After,
    param response_format) at once, while beta's grammar is still taken and converted."""
    grammars = live.server.config.app.state.ctx.grammars
    slow = [deep_schema(450, f"budget {i}") for i in range(grammars.per_tenant)]
    attack = threading.Thread(target=_attack, args=(live.url, slow))
    attack.start()
    try:
        while grammars._inflight.get("acme", 0) < grammars.per_tenant:
            assert attack.is_alive(), "acme's grammars ended before all were in flight"
            time.sleep(0.01)
        with httpx.Client(base_url=live.url, timeout=120) as http:
            over = _constrained(http, "acme/support", deep_schema(450, "one too many"))
            other = _constrained(http, "beta/chat", {"type": "object", "properties": {
                "budget": {"type": "integer"}}})
    finally:
        attack.join()
    assert over.status_code == 429, over.text
    assert int(over.headers["Retry-After"]) >= 1
    error = over.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "rate_limit_exceeded", error
    assert f"{grammars.per_tenant} grammars of this tenant" in error["message"]
    assert other.status_code == 200, other.text
