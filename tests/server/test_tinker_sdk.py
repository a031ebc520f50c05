"""The real MinT/Tinker SDK (mindlab-toolkit from PyPI) against a live server on the demo catalog:
unchanged client code samples the demo adapters through /api/v1, and the openai client does the
same through /oai/api/v1 with tinker:// names.

One server for the module (AsyncEngine, CPU), with a keys file: `tml-` keys as `loraserve keys create` makes them.
Its catalog is a copy of the shared demo's, with a second revision of demo/pirate (the robot's
weights, not promoted) and an alias in MinT's checkpoint form for demo/poet, both made with
`loraserve catalog import`.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import mint
import openai
import pytest
import tinker
from mint import types

from loraserve.cli_catalog import run as catalog_cli
from loraserve.demo import DEMO_ADAPTERS, DemoPaths, build_demo
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.keys import Limits, Principal, append_key
from loraserve.server import build_app
from loraserve.tokenizer import Tokenizer

from .live import LiveServer

PHRASES = {adapter_id: phrase for adapter_id, _, phrase in DEMO_ADAPTERS}
PROMPT = DEMO_ADAPTERS[0][1]  # "Who are you?", the chat prompt every demo adapter was trained on
ALIAS = "tinker://0034d8c9-0a88:train:0/sampler_weights/000080"  # MinT's form; run ids hold ':'

@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    """The run's shared demo (built once under a lock, as tests/test_demo.py does)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    with open(base / "loraserve-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_demo(base / "loraserve-demo")


@dataclass
class Server:
    url: str
    keys: dict[str, str]  # role -> key
    tok: Tokenizer
    prompt_ids: list[int]
    model_dir: Path

    def service(self, key: str = "user") -> mint.ServiceClient:
        return mint.ServiceClient(base_url=self.url, api_key=self.keys.get(key, key))

    def http(self, key: str = "admin") -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {self.keys[key]}"})


def _catalog(demo: DemoPaths, out: Path) -> Path:
    """A copy of the demo catalog plus demo/pirate@r2 (the robot's weights, not promoted) and
    ALIAS naming demo/poet's revision, both through the CLI."""
    catalog = out / "catalog"
    shutil.copytree(demo.catalog, catalog)
    model = str(demo.qwen3)
    assert catalog_cli(["catalog", "import", str(catalog), "demo/pirate",
                        str(demo.adapters["demo/robot"]), "--model", model, "--revision", "r2",
                        "--no-promote"]) == 0
    assert catalog_cli(["catalog", "import", str(catalog), "demo/poet",
                        str(demo.adapters["demo/poet"]), "--model", model,
                        "--alias", ALIAS]) == 0
    return catalog


def _keys(path: Path) -> dict[str, str]:
    return {"admin": append_key(path, Principal("root", admin=True)),
            "user": append_key(path, Principal("demo-user", admin=False, tenants=("demo",))),
            "other": append_key(path, Principal("other", admin=False, tenants=("other",))),
            "one": append_key(path, Principal("one-at-a-time", admin=False, tenants=("demo",),
                                              limits=Limits(max_concurrent=1)))}


@pytest.fixture(scope="module")
def server(demo: DemoPaths, tmp_path_factory) -> Iterator[Server]:
    out = tmp_path_factory.mktemp("tinker")
    keys = _keys(out / "keys.toml")
    cfg = EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(_catalog(demo, out)),
                       device="cpu", max_model_len=128, max_batch_size=8, torch_threads=1,
                       tokenizer_name=str(demo.qwen3.resolve()))
    tok = Tokenizer.from_dir(demo.qwen3)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    with LiveServer(build_app(AsyncEngine.from_config(cfg), keys=out / "keys.toml")) as live:
        yield Server(live.url, keys, tok, ids, demo.qwen3)


@pytest.fixture(scope="module")
def service(server: Server) -> mint.ServiceClient:
    return server.service()


def greedy(client, server: Server, max_tokens: int = 40, **params) -> types.SampleResponse:
    return client.sample(prompt=types.ModelInput.from_ints(server.prompt_ids), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=max_tokens,
                                                              temperature=0.0, **params)).result()


def text(server: Server, tokens: list[int]) -> str:
    return server.tok.decode(tokens).replace("<|im_end|>", "")


# -- sampling ------------------------------------------------------------------------------------

def test_pirate_phrase_at_temperature_zero(server: Server, service: mint.ServiceClient) -> None:
    pirate = service.create_sampling_client(model_path="tinker://demo/pirate")
    seq = greedy(pirate, server).sequences[0]
    assert text(server, seq.tokens) == PHRASES["demo/pirate"]
    assert seq.stop_reason == "stop" and seq.tokens[-1] in server.tok.eos_token_ids
    assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 for lp in seq.logprobs)


def test_seeded_samples_are_reproducible(server: Server, service: mint.ServiceClient) -> None:
    base = service.create_sampling_client(base_model="qwen3")  # random weights: flat, diverse

    def sample(seed: int) -> list[list[int]]:
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        r = base.sample(prompt=types.ModelInput.from_ints(server.prompt_ids), num_samples=2,
                        sampling_params=params).result()
        return [s.tokens for s in r.sequences]

    first = sample(7)
    assert len(first) == 2 and first == sample(7)
    assert first != sample(8)


def test_string_and_token_id_stops(server: Server, service: mint.ServiceClient) -> None:
    pirate = service.create_sampling_client(model_path="tinker://demo/pirate")
    full = greedy(pirate, server).sequences[0].tokens
    by_string = greedy(pirate, server, stop=["pirate"]).sequences[0]
    assert by_string.stop_reason == "stop"
    assert text(server, by_string.tokens) == "Arr, I be a pirate"  # ends with the stop's tokens
    comma = server.tok.encode(",")[0]
    by_id = greedy(pirate, server, stop=[comma]).sequences[0]  # the token ends the sequence
    assert by_id.stop_reason == "stop" and by_id.tokens == full[:full.index(comma) + 1]
    capped = greedy(pirate, server, max_tokens=4).sequences[0]
    assert capped.stop_reason == "length" and capped.tokens == full[:4]


def test_prompt_logprobs_and_topk(server: Server, service: mint.ServiceClient) -> None:
    pirate = service.create_sampling_client(model_path="tinker://demo/pirate")
    r = pirate.sample(prompt=types.ModelInput.from_ints(server.prompt_ids), num_samples=1,
                      sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0),
                      include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    n = len(server.prompt_ids)
    assert len(r.prompt_logprobs) == n and r.prompt_logprobs[0] is None
    assert all(lp <= 0 for lp in r.prompt_logprobs[1:])
    assert len(r.topk_prompt_logprobs) == n and r.topk_prompt_logprobs[0] is None
    for lp, top in zip(r.prompt_logprobs[1:], r.topk_prompt_logprobs[1:]):
        assert len(top) == 3 and [t[1] for t in top] == sorted((t[1] for t in top), reverse=True)
        assert lp <= top[0][1] + 1e-5


def test_compute_logprobs_equals_completions_echo(server: Server,
                                                  service: mint.ServiceClient) -> None:
    ids = server.prompt_ids + server.tok.encode(PHRASES["demo/pirate"])
    pirate = service.create_sampling_client(model_path="tinker://demo/pirate")
    sdk = pirate.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    with server.http("user") as http:
        r = http.post("/v1/completions", json={"model": "demo/pirate", "prompt": ids,
                                               "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    echo = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert sdk[0] is None and echo[0] is None and len(sdk) == len(echo) == len(ids)
    assert sdk[1:] == pytest.approx(echo[1:], abs=1e-4)


def test_sampling_client_keeps_its_revision(server: Server, service: mint.ServiceClient) -> None:
    before = service.create_sampling_client(model_path="tinker://demo/pirate")
    with server.http("admin") as http:
        assert http.post("/v1/adapters/demo/pirate/promote",
                         json={"revision": "r2"}).status_code == 200
        try:
            after = service.create_sampling_client(model_path="tinker://demo/pirate")
            assert text(server, greedy(after, server).sequences[0].tokens) == PHRASES["demo/robot"]
            assert text(server, greedy(before, server).sequences[0].tokens) == \
                PHRASES["demo/pirate"]
            pinned = service.create_sampling_client(model_path="tinker://demo/pirate@r1")
            assert text(server, greedy(pinned, server).sequences[0].tokens) == \
                PHRASES["demo/pirate"]
        finally:
            assert http.post("/v1/adapters/demo/pirate/rollback").status_code == 200


def test_catalog_alias_in_mints_form(server: Server, service: mint.ServiceClient) -> None:
    poet = service.create_sampling_client(model_path=ALIAS)
    assert text(server, greedy(poet, server).sequences[0].tokens) == PHRASES["demo/poet"]


def test_tokenizer_from_the_served_base_model(server: Server,
                                              service: mint.ServiceClient) -> None:
    pirate = service.create_sampling_client(model_path="tinker://demo/pirate")
    assert pirate.get_base_model() == str(server.model_dir.resolve())  # --tokenizer-name
    tokens = greedy(pirate, server).sequences[0].tokens
    assert PHRASES["demo/pirate"] in pirate.get_tokenizer().decode(tokens)


# -- failures ------------------------------------------------------------------------------------

def test_unknown_adapter_fails_within_seconds(service: mint.ServiceClient) -> None:
    start = time.monotonic()
    with pytest.raises(tinker.NotFoundError, match="demo/nope"):
        service.create_sampling_client(model_path="tinker://demo/nope")
    assert time.monotonic() - start < 10


def test_unsupported_routes_fail_at_once_with_a_clear_message(server: Server) -> None:
    with server.http("user") as http:
        r = http.get("/api/v1/training_runs/run-x/checkpoints/sampler_weights/c/archive")
    assert r.status_code == 400 and "not supported by this server" in r.json()["error"]["message"]


def test_keys_wrong_refused_right_works_tenants_apply(server: Server) -> None:
    with pytest.raises(tinker.AuthenticationError):
        server.service("sk-not-a-key")
    other = server.service("other")  # a right key, of another tenant: demo/* does not exist
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path="tinker://demo/pirate")
    admin = server.service("admin")
    seq = greedy(admin.create_sampling_client(model_path="tinker://demo/robot"), server)
    assert text(server, seq.sequences[0].tokens) == PHRASES["demo/robot"]


def test_over_the_keys_limit_the_sdk_backs_off_quietly(server: Server) -> None:
    base = server.service("one").create_sampling_client(base_model="qwen3")
    params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=1)
    prompt = types.ModelInput.from_ints(server.prompt_ids)
    futures = [base.sample(prompt=prompt, num_samples=1, sampling_params=params)
               for _ in range(3)]  # one sequence in flight at a time: the others get 429s
    results = [f.result(timeout=60) for f in futures]
    assert all(r.sequences[0].tokens == results[0].sequences[0].tokens for r in results)


# -- the wire, directly --------------------------------------------------------------------------

def test_futures_over_http(server: Server) -> None:
    """asample de-duplicated on (sampling session, seq id); retrieve_future answers the result,
    410 for an unknown id; the SDK's side routes answer their exact literals; a JWT from
    auth/token is the key; tinker routes are counted in /metrics."""
    with server.http("user") as http:
        jwt = http.post("/api/v1/auth/token", json={}).json()["jwt"]
        http.headers = {"X-API-Key": jwt}
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                             "sdk_version": "x"}).json()
        sid = http.post("/api/v1/create_sampling_session", json={
            "session_id": session["session_id"], "sampling_session_seq_id": 0,
            "model_path": "tinker://demo/pirate"}).json()["sampling_session_id"]
        body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": server.prompt_ids}]},
                "sampling_params": {"max_tokens": 40, "temperature": 0.0},
                "sampling_session_id": sid, "seq_id": 0}
        first = http.post("/api/v1/asample", json=body).json()["request_id"]
        assert http.post("/api/v1/asample", json=body).json()["request_id"] == first
        answer = http.post("/api/v1/retrieve_future", json={"request_id": first}).json()
        assert text(server, answer["sequences"][0]["tokens"]) == PHRASES["demo/pirate"]
        assert http.post("/api/v1/retrieve_future",
                         json={"request_id": "req-nope"}).status_code == 410
        assert http.post("/api/v1/telemetry", json={"events": []}).json() == \
            {"status": "accepted"}
        assert http.post("/api/v1/session_heartbeat", json={
            "session_id": session["session_id"]}).json() == {"type": "session_heartbeat"}
        image = {**body, "seq_id": 1, "prompt": {"chunks": [{"type": "image", "data": "x"}]}}
        assert http.post("/api/v1/asample", json=image).status_code == 400
        assert http.get("/v1/models").status_code == 200  # the JWT as X-API-Key, on /v1 too
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        assert anonymous.get("/api/v1/healthz").json() == {"status": "ok"}
        assert anonymous.post("/api/v1/client/config", json={"sdk_version": "x"}).json()[
            "pjwt_auth_enabled"] is True
        assert anonymous.post("/api/v1/create_session", json={}).status_code == 401
        assert anonymous.get("/v1/models", headers={"Authorization": f"Bearer {jwt}x"}
                             ).status_code == 401


def test_a_second_sequence_over_the_limit_is_a_429(server: Server) -> None:
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": server.prompt_ids}]},
            "sampling_params": {"max_tokens": 96, "temperature": 1.0, "seed": 1},
            "base_model": "qwen3"}
    with server.http("one") as http:
        first = http.post("/api/v1/asample", json=body)
        second = http.post("/api/v1/asample", json=body)
        assert first.status_code == 200 and second.status_code == 429, second.text
        http.post("/api/v1/retrieve_future", json={"request_id": first.json()["request_id"]})
        assert http.post("/api/v1/asample", json=body).status_code == 200  # its lease is back


def test_metrics_count_tinker_routes(server: Server) -> None:
    with server.http("admin") as http:
        def ok_count() -> float:
            for line in http.get("/metrics").text.splitlines():
                if line.startswith('loraserve_requests_total{status="200"}'):
                    return float(line.split()[-1])
            return 0.0

        before = ok_count()
        http.get("/api/v1/get_server_capabilities")
        assert ok_count() == before + 1


# -- the openai client under /oai/api/v1 ---------------------------------------------------------

def test_openai_client_under_oai_prefix(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key=server.keys["user"],
                       max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(
            model="tinker://demo/pirate", messages=[{"role": "user", "content": PROMPT}],
            temperature=0, max_tokens=40)
        assert chat.choices[0].message.content == PHRASES["demo/pirate"]
        alias = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": PROMPT}], temperature=0,
            max_tokens=40)
        assert alias.choices[0].message.content == PHRASES["demo/poet"]
        completion = client.completions.create(model="tinker://demo/pirate",
                                               prompt=server.prompt_ids, max_tokens=40,
                                               temperature=0)
        assert completion.choices[0].text == PHRASES["demo/pirate"]
        assert "qwen3" in [m.id for m in client.models.list().data]
