"""The real Tinker SDK (mindlab-toolkit), unchanged, trains on the served base: the seeds' SFT
loop teaches the tiny demo base a fixed answer that its sampler then gives greedily, and a small
RL loop (8 samples per prompt, a reward, importance_sampling, optim step, new sampler) moves the
policy toward the reward. The server is started by the test (AsyncEngine, CPU, a keys file), with
a copy of the demo catalog; the saved revisions are served through /v1 as well.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import mint
import pytest
import tinker
from mint import types

from loraserve.catalog.errors import AdapterNotFound
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.keys import Limits, Principal, append_key
from loraserve.server import build_app
from loraserve.server import request_log as rl
from loraserve.tokenizer import Tokenizer

from .live import LiveServer
from .test_tinker_sdk import demo  # noqa: F401  (the shared demo build, a fixture)

ANSWER = "I am a test."
BASE = "qwen3"


@dataclass
class Server:
    url: str
    keys: dict[str, str]
    tok: Tokenizer
    prompt: list[int]
    engine: AsyncEngine

    def service(self, key: str = "user") -> mint.ServiceClient:
        return mint.ServiceClient(base_url=self.url, api_key=self.keys[key])

    def http(self, key: str = "user") -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {self.keys[key]}"})


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    out = tmp_path_factory.mktemp("tinker_train")
    shutil.copytree(demo.catalog, out / "catalog")
    keys = {"user": append_key(out / "keys.toml", Principal("trainer", admin=False, tenants=("lab",))),
            "other": append_key(out / "keys.toml", Principal("other", admin=False, tenants=("other",))),
            "limited": append_key(out / "keys.toml", Principal("limited", admin=False, tenants=("lim",),
                                                               limits=Limits(tokens_per_minute=60)))}
    cfg = EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(out / "catalog"), device="cpu",
                       max_model_len=128, max_batch_size=16, torch_threads=1, train_max_tokens=24,
                       train_state_dir=str(out / "state"))
    tok = Tokenizer.from_dir(demo.qwen3)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Who are you?"}]))
    engine = AsyncEngine.from_config(cfg)
    with LiveServer(build_app(engine, keys=out / "keys.toml")) as live:
        yield Server(live.url, keys, tok, prompt, engine)


def sft_datum(server: Server) -> types.Datum:
    """prompt + ANSWER + <|im_end|>, shifted by one; weight 1 on the answer's tokens only."""
    answer = server.tok.encode(ANSWER) + [server.tok.eos_token_ids[0]]
    full = server.prompt + answer
    weights = [0.0] * (len(server.prompt) - 1) + [1.0] * len(answer)
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:], "weights": weights})


def greedy_text(server: Server, sampler, max_tokens: int = 24) -> str:
    r = sampler.sample(prompt=types.ModelInput.from_ints(server.prompt), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=0.0)).result()
    return server.tok.decode(r.sequences[0].tokens).replace("<|im_end|>", "")


def test_sft_loop_teaches_the_answer(server: Server) -> None:
    service = server.service()
    trainer = service.create_lora_training_client(base_model=BASE, rank=8, seed=0)
    before = trainer.save_weights_and_get_sampling_client()  # B = 0: the base's own answer
    base_answer = greedy_text(server, before)
    assert base_answer != ANSWER
    datum = sft_datum(server)
    losses = []
    for _ in range(40):
        fb = trainer.forward_backward([datum], "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-3))
        out = fb.result()
        step.result()
        losses.append(out.metrics["loss:sum"])
        if losses[-1] < 0.05:
            break
    assert losses[-1] < 0.05 < losses[0]
    after = trainer.save_weights_and_get_sampling_client()
    assert greedy_text(server, after) == ANSWER
    assert greedy_text(server, before) == base_answer  # a sampler made before a save keeps its revision
    with server.http() as http:  # the unnamed save's own name resolves to the same revision
        path = http.get(f"/api/v1/samplers/{after._sampling_session_id}").json()["model_path"]
    assert path.startswith(f"tinker://lab/{trainer.model_id}@s")
    assert greedy_text(server, service.create_sampling_client(model_path=path)) == ANSWER
    named = trainer.save_weights_for_sampler("sft-final").result().path
    assert named == f"tinker://{trainer.model_id}/sampler_weights/sft-final"
    assert greedy_text(server, service.create_sampling_client(model_path=named)) == ANSWER
    with server.http() as http:  # the same revision through the OpenAI-compatible route
        r = http.post("/v1/completions", json={"model": f"lab/{trainer.model_id}@sft-final",
                                               "prompt": server.prompt, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].replace("<|im_end|>", "") == ANSWER
    with pytest.raises(tinker.NotFoundError):  # another tenant: the run's revision does not exist
        server.service("other").create_sampling_client(model_path=named)


def test_forward_matches_the_samplers_logprobs(server: Server) -> None:
    """A fresh run (B = 0) scores tokens as the serving base does."""
    service = server.service()
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=1, train_unembed=False)
    datum = sft_datum(server)
    out = trainer.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
    tokens = datum.model_input.to_ints() + [datum.loss_fn_inputs["target_tokens"].tolist()[-1]]
    served = service.create_sampling_client(base_model=BASE).compute_logprobs(
        types.ModelInput.from_ints(tokens)).result()
    assert len(logprobs) == len(served) - 1
    assert max(abs(a - b) for a, b in zip(logprobs, served[1:])) < 1e-3
    with server.http() as http:  # unload_model: the REST route (the SDK's client has no method)
        future = http.post("/api/v1/unload_model", json={"model_id": trainer.model_id}).json()
        done = http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
        assert done == {"model_id": trainer.model_id, "type": "unload_model"}
    with pytest.raises(Exception, match="does not exist"):
        trainer.get_info()


def test_rl_loop_moves_the_policy_toward_the_reward(server: Server) -> None:
    """8 samples per prompt, reward 1 for an even first token; importance_sampling with
    group-centred advantages, optim step, a new sampler each iteration."""
    service = server.service()
    trainer = service.create_lora_training_client(base_model=BASE, rank=8, seed=2)
    prompt = types.ModelInput.from_ints(server.prompt)

    def even_mass(sampler) -> float:
        """The probability of an even first token, over the 20 likeliest (the prompt logprobs of
        the position after the prompt)."""
        r = sampler.sample(prompt=types.ModelInput.from_ints(server.prompt + [0]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                           topk_prompt_logprobs=20).result()
        return sum(math.exp(lp) for tok, lp in r.topk_prompt_logprobs[-1] if tok % 2 == 0)

    sampler = trainer.save_weights_and_get_sampling_client()
    start = even_mass(sampler)
    for it in range(4):
        r = sampler.sample(prompt=prompt, num_samples=8, sampling_params=types.SamplingParams(
            max_tokens=4, temperature=1.0, seed=100 + it)).result()
        rewards = [1.0 if s.tokens[0] % 2 == 0 else 0.0 for s in r.sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for s, reward in zip(r.sequences, rewards):
            full = server.prompt + s.tokens
            n_prompt = len(server.prompt) - 1
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": [0.0] * n_prompt + s.logprobs,
                "advantages": [0.0] * n_prompt + [reward - mean] * len(s.tokens)}))
        fb = trainer.forward_backward(data, "importance_sampling")
        trainer.optim_step(types.AdamParams(learning_rate=3e-2)).result()
        assert math.isfinite(fb.result().metrics["loss:sum"])
        sampler = trainer.save_weights_and_get_sampling_client()
    assert even_mass(sampler) > start + 0.05


def test_state_round_trip_listings_and_faults(server: Server) -> None:
    service = server.service()
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=3, train_mlp=False)
    datum = sft_datum(server)
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("ckpt-1").result().path
    assert path == f"tinker://{trainer.model_id}/weights/ckpt-1"
    resumed = service.create_training_client_from_state_with_optimizer(path)
    for t in (trainer, resumed):  # the same next step from the same state
        t.forward_backward([datum], "cross_entropy").result()
        t.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    b = resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert a == pytest.approx(b, rel=1e-6)
    info = trainer.get_info()
    assert info.model_id == trainer.model_id and info.lora_rank == 4
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds is not supported"):
        trainer.save_weights_for_sampler("expiring", ttl_seconds=60).result()
    rest = service.create_rest_client()
    runs = {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    assert {trainer.model_id, resumed.model_id} <= runs
    ckpts = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert [c.tinker_path for c in ckpts] == [path]
    other = server.service("other").create_rest_client()
    assert trainer.model_id not in {r.training_run_id for r in other.list_training_runs().result().training_runs}
    n = len(datum.model_input.to_ints())  # sampler logprobs far below the learner's: ratio inf
    bad = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        "target_tokens": datum.loss_fn_inputs["target_tokens"], "logprobs": [-1e4] * n, "advantages": [1.0] * n})
    good = trainer.save_weights_and_get_sampling_client()
    with pytest.raises(Exception, match="loss of datum 0 is -inf"):
        trainer.forward_backward([bad], "importance_sampling").result()
    with pytest.raises(Exception, match="not supported here"):
        trainer.forward_backward([datum], "dro").result()
    after = trainer.save_weights_and_get_sampling_client()
    assert greedy_text(server, after) == greedy_text(server, good)  # the failed step changed nothing


def test_custom_loss_runs_as_cross_entropy(server: Server) -> None:
    """forward_backward_custom: the SDK's forward, its loss on the client, a cross_entropy whose
    weights are the loss's gradient; a custom CE gives the built-in CE's loss."""
    import torch

    trainer = server.service().create_lora_training_client(base_model=BASE, rank=4, seed=4, train_mlp=False)
    datum = sft_datum(server)
    weights = torch.tensor(datum.loss_fn_inputs["weights"].tolist())

    def custom(data, logprobs_list):
        loss = sum((-lp * weights).sum() for lp in logprobs_list)
        return loss, {"custom:sum": float(loss.detach())}

    out = trainer.forward_backward_custom([datum], custom).result()
    ce = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert out.metrics["custom:sum"] == pytest.approx(ce, rel=1e-5)


def test_training_tokens_count_against_the_keys_tokens_per_minute(server: Server) -> None:
    trainer = server.service("limited").create_lora_training_client(base_model=BASE, rank=2, seed=5)
    body = {"model_id": trainer.model_id, "forward_input": {"loss_fn": "cross_entropy", "data": [{
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": list(range(1, 41))}]},
        "loss_fn_inputs": {"target_tokens": {"data": list(range(2, 42)), "dtype": "int64", "shape": [40]},
                           "weights": {"data": [1.0] * 40, "dtype": "float32", "shape": [40]}}}]}}
    long = {"model_id": trainer.model_id, "forward_input": {"loss_fn": "cross_entropy", "data": [{
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1] * 129}]}, "loss_fn_inputs": {}}]}}
    with server.http("limited") as http:
        r = http.post("/api/v1/forward", json=long)  # past --max-model-len: refused, nothing charged
        assert r.status_code == 400 and "a datum holds 1 to 128" in r.text
        assert http.post("/api/v1/forward", json=body).status_code == 200  # 40 of 60 tokens
        r = http.post("/api/v1/forward", json=body)
    assert r.status_code == 429 and "tokens_per_minute" in r.text


def test_a_sampler_save_is_served_before_its_catalog_write(server: Server, monkeypatch) -> None:
    """save_weights_and_get_sampling_client's revision is served from the factors in memory: its
    sampler answers while the catalog write is held back; a lookup by its name waits for the
    write; once written, /v1 serves the same revision; a later save is written after it."""
    catalog = server.engine.catalog.catalog
    put, held, release = catalog.put_revision, threading.Event(), threading.Event()

    def held_put(*args, **kw):
        held.set()
        assert release.wait(60)
        return put(*args, **kw)

    monkeypatch.setattr(catalog, "put_revision", held_put)
    service = server.service()
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=0)
    trainer.forward_backward([sft_datum(server)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    sampler = trainer.save_weights_and_get_sampling_client()
    first = greedy_text(server, sampler, 8)
    assert held.is_set() and not release.is_set()  # answered while the write was held
    with pytest.raises(AdapterNotFound):  # its first revision: nothing of it written yet
        catalog.resolve(f"lab/{trainer.model_id}", "s1")
    with server.http() as http:
        path = http.get(f"/api/v1/samplers/{sampler._sampling_session_id}").json()["model_path"]
    by_name = concurrent.futures.ThreadPoolExecutor(1)
    lookup = by_name.submit(service.create_sampling_client, model_path=path)
    release.set()
    assert greedy_text(server, lookup.result(timeout=60), 8) == first
    by_name.shutdown()
    assert catalog.resolve(f"lab/{trainer.model_id}", "s1").revision == "s1"
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": f"lab/{trainer.model_id}@s1", "prompt": server.prompt,
                                               "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].replace("<|im_end|>", "") == first
    trainer.save_weights_and_get_sampling_client()
    trainer.save_weights_for_sampler("after").result()  # waits for s2's write, then its own
    assert catalog.policy(f"lab/{trainer.model_id}").promoted == "after"
    assert catalog.resolve(f"lab/{trainer.model_id}", "s2").revision == "s2"


def test_request_log_lines_name_the_run_its_tenant_and_tokens(server: Server) -> None:
    """Tinker's routes fill the request's log line as /v1's do: a training call names its run,
    the run's tenant, the tokens it charged and its future; a sample its adapter and prompt."""
    lines: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.request)

    handler, level = Keep(), rl.access_log.level
    rl.access_log.addHandler(handler)
    rl.access_log.setLevel(logging.INFO)
    try:
        trainer = server.service().create_lora_training_client(base_model=BASE, rank=2, seed=0)
        datum = sft_datum(server)
        trainer.forward_backward([datum], "cross_entropy").result()
        greedy_text(server, trainer.save_weights_and_get_sampling_client(), max_tokens=2)
    finally:
        rl.access_log.removeHandler(handler)
        rl.access_log.setLevel(level)
    [fb] = [line for line in lines if line["path"] == "/api/v1/forward_backward"]
    assert (fb["tenant"], fb["model"], fb["status"]) == ("lab", trainer.model_id, 200)
    assert fb["prompt_tokens"] == datum.model_input.length and fb["response_id"].startswith("req")
    [sample] = [line for line in lines if line["path"] == "/api/v1/asample"]
    assert sample["tenant"] == "lab" and sample["adapter"].startswith(f"lab/{trainer.model_id}@")
    assert sample["prompt_tokens"] == len(server.prompt) and sample["response_id"].startswith("req")


def test_training_on_another_base_fails_at_once(server: Server) -> None:
    start = time.monotonic()
    with pytest.raises(tinker.NotFoundError, match="not served here"):
        server.service().create_lora_training_client(base_model="Qwen/Qwen3-8B")
    assert time.monotonic() - start < 10
