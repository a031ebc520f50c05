"""The Tinker routes' parts without a server: login tokens, the bounded state, sample planning
and answers, tinker:// names."""
from __future__ import annotations

from pathlib import Path

import jwt
import pytest

from loraserve.engine.directory import AdapterDirectory
from loraserve.engine.types import RequestOutput, TokenLogprob
from loraserve.keys import KeyFileError, Principal, append_key, load_keys, new_key
from loraserve.server.errors import APIError
from loraserve.server.metrics import ServerMetrics
from loraserve.server.tenancy import Tenancy, TenancyConfig
from loraserve.server.tinker.sampling import (SampleBody, SequenceAborted, SequenceOutput,
                                              failure, plan_sample, sample_response)
from loraserve.server.tinker.state import Future, FutureStore, Recent
from loraserve.server.tokens import TokenIssuer

from .fake_engine import FakeEngine


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- tokens --------------------------------------------------------------------------------------

def test_a_token_is_its_key_while_the_key_lasts(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    key = append_key(path, Principal("acme", admin=False, tenants=("acme",)))
    assert key.startswith("tml-")
    tenancy = Tenancy(TenancyConfig(keys_file=path), ServerMetrics())
    principal = tenancy.find(key)
    token = tenancy.tokens.mint(principal, tenancy.keys)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["sub"] == "acme" and claims["exp"] - claims["iat"] == 3600
    assert tenancy.find(token) == principal
    assert tenancy.caller("/api/v1/asample", "POST", token) == principal
    assert tenancy.find(token[:-2] + "xx") is None                  # a forged signature
    assert TokenIssuer().principal(token, tenancy.keys) is None     # another server's secret
    path.write_text("")                                             # the key is removed
    tenancy.reload_keys(None)
    assert tenancy.find(token) is None


def test_expired_tokens_and_the_configured_secret(monkeypatch, tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    append_key(path, Principal("acme", admin=False, tenants=("acme",)))
    store = load_keys(path)
    principal = store.entries[0].principal
    monkeypatch.setenv("LORASERVE_JWT_SECRET", "shared")
    token = TokenIssuer().mint(principal, store)
    assert TokenIssuer().principal(token, store) == principal  # another server, same secret
    assert TokenIssuer(ttl_s=-10).principal(TokenIssuer(ttl_s=-10).mint(principal, store),
                                            store) is None


def test_key_prefixes() -> None:
    """Every key starts with tml-, the one prefix the Tinker SDK takes (its
    ApiKeyAuthProvider refuses any other); a longer prefix may follow it."""
    assert new_key().startswith("tml-") and new_key("tml-acme-").startswith("tml-acme-")
    for bad in ("bad prefix", "sk-", "ls-", "", "tml", "tml-" + "x" * 13):
        with pytest.raises(KeyFileError, match="tml-"):
            new_key(bad)


# -- state ---------------------------------------------------------------------------------------

def test_recent_forgets_idle_and_least_recent() -> None:
    clock = Clock()
    recent: Recent[int] = Recent(max_items=2, idle_s=10, clock=clock)
    recent.put("a", 1)
    recent.put("b", 2)
    assert recent.get("a") == 1
    recent.put("c", 3)  # "b" was used least recently
    assert recent.get("b") is None and len(recent) == 2
    clock.now = 11
    assert recent.get("a") is None and recent.get("c") is None


def test_future_store_keeps_answers_then_forgets_them() -> None:
    clock = Clock()
    store = FutureStore(keep_s=60, max_done=2, clock=clock)
    f = Future("req-1", "k", dedupe=("s", 0))
    store.add(f)
    assert store.pending == 1 and store.for_seq(("s", 0), "k") is f
    assert store.get("req-1", "other") is None  # another key's
    store.finish(f, {"sequences": []})
    assert f.finished.is_set() and store.pending == 0
    clock.now = 59
    assert store.get("req-1", "k") is f
    clock.now = 61
    assert store.get("req-1", "k") is None and store.for_seq(("s", 0), "k") is None
    for i in range(3):  # beyond max_done, the oldest answers go first
        g = Future(f"req-x{i}", None)
        store.add(g)
        store.finish(g, {})
    assert store.get("req-x0", None) is None and store.get("req-x2", None) is not None


def test_a_refused_future_is_forgotten() -> None:
    store = FutureStore()
    f = Future("req-1", None, dedupe=("s", 0))
    store.add(f)
    store.discard(f)
    assert store.get("req-1", None) is None and store.for_seq(("s", 0), None) is None


# -- planning and answers -------------------------------------------------------------------------

def body(**overrides) -> SampleBody:
    raw = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
           "sampling_params": {"max_tokens": 4, "temperature": 0.5, "seed": 3}, **overrides}
    return SampleBody.model_validate(raw)


def test_plan_maps_the_sdks_parameters() -> None:
    engine = FakeEngine()
    plan = plan_sample(body(sampling_params={"stop": [5, 7], "seed": 1}, num_samples=3,
                            topk_prompt_logprobs=2), engine, 16)
    p = plan.params
    assert plan.n == 3 and p.stop_token_ids == [5, 7] and p.stop == [] and p.logprobs == 0
    assert p.prompt_logprobs == 2 and p.max_tokens == engine.max_model_len - 3
    assert plan_sample(body(sampling_params={"stop": "x"}), engine, 16).params.stop == ["x"]
    assert plan_sample(body(), engine, 16).params.prompt_logprobs is None


@pytest.mark.parametrize("overrides, param", [
    ({"num_samples": 17}, "num_samples"), ({"num_samples": 0}, "num_samples"),
    ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ({"prompt": {"chunks": [{"type": "image", "data": "x", "format": "png"}]}}, "prompt.chunks.0"),
    ({"prompt": {"chunks": []}}, "prompt"),
    ({"sampling_params": {"stop": [10**6]}}, "sampling_params.stop"),
])
def test_plan_refuses_with_a_400_naming_the_field(overrides: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        plan_sample(body(**overrides), FakeEngine(), 16)
    assert err.value.status == 400 and err.value.param == param


def test_sample_response_shape_and_aborts() -> None:
    plan = plan_sample(body(prompt_logprobs=True, topk_prompt_logprobs=1), FakeEngine(), 16)
    seq = SequenceOutput()
    seq.add(RequestOutput("r", [4, 5], "", [TokenLogprob(4, -0.5, {}),
                                            TokenLogprob(5, float("-inf"), {})], None, "stop"))
    lps = [None, TokenLogprob(2, -1.0, {2: -1.0, 9: -0.5}), TokenLogprob(3, -2.0, {3: -2.0})]
    answer = sample_response(plan, [seq], lps)
    assert answer["sequences"] == [{"stop_reason": "stop", "tokens": [4, 5],
                                    "logprobs": [-0.5, -9999.0]}]
    assert answer["prompt_logprobs"] == [None, -1.0, -2.0]
    assert answer["topk_prompt_logprobs"] == [None, [[9, -0.5]], [[3, -2.0]]]
    seq.finish_reason = "abort"
    with pytest.raises(SequenceAborted) as aborted:
        sample_response(plan, [seq], lps)
    assert failure(aborted.value)["category"] == "server"
    assert failure(APIError(404, "gone")) == {"error": "gone", "category": "user"}


# -- names ---------------------------------------------------------------------------------------

def test_tinker_names_without_a_catalog() -> None:
    names = AdapterDirectory("fake-base")  # the one resolver's names (no alias is recorded)
    assert names.canonical("tinker://demo/pirate@r2") == "demo/pirate@r2"
    assert names.canonical("tinker://fake-base") == "fake-base"
    assert names.canonical("demo/pirate") == "demo/pirate"


# -- training on a hosting without a trainer ------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/api/v1/create_model", {"session_id": "s", "model_seq_id": 0, "base_model": "fake-base",
                              "lora_config": {"rank": 4}}),
    ("/api/v1/forward_backward", {"model_id": "run-x", "forward_backward_input": {
        "data": [], "loss_fn": "cross_entropy"}}),
    ("/api/v1/optim_step", {"model_id": "run-x", "adam_params": {"learning_rate": 0.1}}),
])
def test_training_routes_refuse_where_the_hosting_does_not_train(http, path: str, body: dict) -> None:
    """The fake engine has trainer = None, as Ray replicas do: a 400 that says so, never a 5xx."""
    r = http.post(path, json=body)
    assert r.status_code == 400 and "does not train" in r.json()["error"]["message"], r.text
    assert http.get("/api/v1/training_runs").status_code == 400
