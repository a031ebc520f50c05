"""engine.trainer on both hostings that train: in process (AsyncEngine) a pass runs in slices of
train_max_tokens with decode steps between them, so a streamed generation keeps producing while
it trains; in the engine-core process (CoreClient) the same operations travel over the socket
and give the numbers a TrainingRun gives here."""
from __future__ import annotations

import asyncio

import pytest
import torch

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.client.core_client import CoreClient
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.training import trainer_of
from loraserve.engine.types import EngineError, GenerateRequest, SamplingParams
from loraserve.model.loader import load_model
from loraserve.train.config import RunConfig
from loraserve.train.run import AdamParams, Datum, TrainingRun

RUN = {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}


def _cfg(base, **kw) -> EngineConfig:
    return EngineConfig(model_dir=str(base), device="cpu", dtype="float32", max_model_len=128,
                        torch_threads=1, **kw)


def _data(n_datums: int = 4, length: int = 12) -> list:
    out = []
    for i in range(n_datums):
        toks = [(7 * i + 3 * j) % 250 + 1 for j in range(length + 1)]
        out.append([toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * length}])
    return out


async def _train_steps(trainer, steps: int = 2) -> list[float]:
    await trainer.create("r", RUN)
    losses = []
    for _ in range(steps):
        result = await trainer.run_pass("r", _data(), "cross_entropy", None, True, "default")
        losses.append(result["metrics"]["loss:sum"])
        await trainer.optim_step("r", ADAM)
    return losses


def test_in_process_slices_interleave_with_decoding(demo_dense):
    """The engine thread's own order of events (EngineCore.trace): with a generation in flight
    it runs a decode step between two training slices (one tenant: its serving and its
    training alternate step for slice)."""
    eng = AsyncEngine.from_config(_cfg(demo_dense, train_max_tokens=12))
    eng.transport.core.trace = events = []  # appended on the engine thread only

    async def main():
        await eng.start()
        # a first create waits for the optimizer's import (seconds on a busy machine), which the
        # generation must not outlive: done before it starts
        await eng.trainer.create("warm", RUN)
        req = GenerateRequest("g", eng.tokenizer.encode("Hi"), SamplingParams(
            max_tokens=100, temperature=0.0, ignore_eos=True), stream=True, tenant="default")
        gen = eng.generate(req)
        await gen.__anext__()  # decoding is under way
        losses = await _train_steps(eng.trainer)
        async for _ in gen:
            pass
        await eng.shutdown()
        return losses

    losses = asyncio.run(main())
    assert losses[1] < losses[0]
    # where each slice ended (a slice that gave way to the decoding part way, "parked", goes on
    # in a later turn: EngineCore._give_way)
    slices = [i for i, e in enumerate(events) if e == "train" and events[i + 1:i + 2] != ["parked"]]
    assert len(slices) == 8  # 4 datums of 12 tokens, one per 12-token slice, two passes
    for a, b in zip(slices, slices[1:]):
        assert "decode" in events[a:b], " ".join(events)


def test_core_process_trains_as_in_process(demo_dense):
    async def run(engine):
        try:
            await engine.start()
            losses = await _train_steps(engine.trainer)
            state = await engine.trainer.state_blob("r")
            await engine.trainer.create("r2", RUN)
            await engine.trainer.load_state("r2", state, True)
            again = await engine.trainer.run_pass("r2", _data(), "cross_entropy", None, False, "default")
            with pytest.raises(EngineError, match="no adapter catalog") as err:
                await engine.trainer.publish("r", "test", "default/r", "s1")
            assert err.value.status == 400
            with pytest.raises(EngineError, match="is not loaded") as err:
                await engine.trainer.run_pass("nope", _data(), "cross_entropy", None, True, "default")
            assert err.value.status == 404
            return losses, again["metrics"]["loss:sum"], await engine.trainer.drop("r")
        finally:
            await engine.shutdown()

    remote = asyncio.run(run(CoreClient(_cfg(demo_dense, train_max_tokens=20))))
    local = TrainingRun(load_model(demo_dense), RunConfig(**RUN))  # the same steps, here
    want = []
    for _ in range(2):
        p = local.start([Datum(torch.tensor(t), {k: torch.tensor(v) for k, v in i.items()})
                         for t, i in _data()], "cross_entropy")
        p.advance(10_000)
        want.append(p.finish().metrics["loss:sum"])
        local.optim_step(AdamParams(**ADAM))
    assert remote[0] == pytest.approx(want, rel=1e-5) and remote[2] is True
    p = local.start([Datum(torch.tensor(t), {k: torch.tensor(v) for k, v in i.items()}) for t, i in _data()],
                    "cross_entropy", backward=False)
    p.advance(10_000)
    assert remote[1] == pytest.approx(p.finish().metrics["loss:sum"], rel=1e-5)


def test_a_moe_runs_expert_lora_is_served_as_it_trained(tmp_path):
    """On a Qwen3-MoE base train_mlp trains every expert; the saved revision (experts packed
    [E, r, in] / [E, out, r], as the catalog's export makes of PEFT's) scores a prompt on the
    serving path as the run's forward does."""
    from loraserve.catalog.store import Catalog
    from loraserve.engine.core.build import build_engine
    from loraserve.model.tiny import random_model, tiny_config, write_tokenizer_files
    from loraserve.model.writer import save_checkpoint

    base = tmp_path / "moe"  # the demo's MoE base, smaller (the demo tokenizer's vocabulary)
    save_checkpoint(random_model(tiny_config("qwen3_moe", hidden_size=64, num_layers=2, num_experts=4,
                                             moe_intermediate_size=32), seed=0), base)
    write_tokenizer_files(base)
    Catalog.create(tmp_path / "catalog", shards=2).close()
    core = trainer_of(build_engine(_cfg(base, catalog_dir=str(tmp_path / "catalog"))))
    assert "experts.up_proj" in core.create("m", RUN)["kinds"]
    data = _data(2, 10)
    for step in range(3):  # B moves off zero
        core.begin("m", f"p{step}", data, "cross_entropy", None, True, "default", 1.0)
        while core.advance(f"p{step}", 64) is None:
            pass
        core.optim_step("m", ADAM)
    core.begin("m", "f", data[:1], "cross_entropy", None, False, "default", 1.0)
    trained = core.advance("f", 64)["outputs"][0]["logprobs"]
    blob = core.publish("m", "test", "default/m", "s1")
    core.engine.adapters.catalog.put_revision("default/m", blob, revision="s1", promote=True, source="test")
    tokens = data[0][0] + [data[0][1]["target_tokens"][-1]]
    seq = core.engine.add_request(GenerateRequest("g", tokens, SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0), adapter="default/m@s1"))
    while core.engine.has_work():
        core.engine.step()
    served = [lp.logprob for lp in seq.prompt_logprobs[1:]]
    assert served == pytest.approx(trained, abs=1e-4)
    base_seq = core.engine.add_request(GenerateRequest("b", tokens, SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0)))
    while core.engine.has_work():
        core.engine.step()
    assert max(abs(a.logprob - b) for a, b in zip(base_seq.prompt_logprobs[1:], trained)) > 1e-3  # it learned
