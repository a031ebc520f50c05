"""Several runs' passes in ONE forward/backward over the base (train/grouped.py): each run's loss,
logprobs and every LoRA gradient equal that run trained alone (1e-5 relative), for runs of
different ranks, target sets and losses, on dense, tied-Llama, sliding-window and prepacked bases;
a run whose loss is not finite fails alone; the engine core batches the passes that wait."""
from __future__ import annotations

import pytest
import torch

from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.training import TrainerCore
from loraserve.train.config import RunConfig, TrainingError
from loraserve.train.grouped import pick, run_group
from loraserve.train.run import TrainingRun

from .test_hosting import RUN, _cfg, _data
from .test_long_datum import _datum, _model

CONFIGS = [dict(rank=2, seed=0), dict(rank=4, seed=1, train_mlp=False),
           dict(rank=3, seed=2, train_attn=False), dict(rank=2, seed=3, train_unembed=False)]
LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cross_entropy"]


def _runs(model) -> list[TrainingRun]:
    runs = []
    for i, cfg in enumerate(CONFIGS):
        run = TrainingRun(model, RunConfig(alpha=4.0, **cfg))
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():  # B is zero at init (every A gradient zero): draw both
            for t in run.factors.named_tensors().values():
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
        runs.append(run)
    return runs


def _data_of(i: int) -> list:
    return [_datum(5 + 3 * i, LOSSES[i], 20 + i), _datum(9 - i, LOSSES[i], 30 + i)]


def _result(p, run):
    out, grads = p.finish(), run.grads
    run.grads = None
    return out, grads


def _close(got, want, what, rel):
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["qwen3", "llama", "mistral_window", "qwen3_packed"])
def test_runs_trained_together_equal_each_alone(name, one_torch_thread):
    model = _model(name).float()
    rel = 3e-5 if name.endswith("packed") else 1e-5  # oneDNN's sums depend on the batch's rows
    runs = _runs(model)
    alone = []
    for i, run in enumerate(runs):
        p = run.start(_data_of(i), LOSSES[i])
        while not p.advance(1000):
            pass
        alone.append(_result(p, run))
    passes = [run.start(_data_of(i), LOSSES[i]) for i, run in enumerate(runs)]
    picks = pick(passes, 1000)
    assert [len(ds) for _, ds in picks] == [2, 2, 2, 2]  # one batch of every run's datums
    assert run_group(picks) == {}
    for i, (p, run) in enumerate(zip(passes, runs)):
        (got, grads), (want, want_grads) = _result(p, run), alone[i]
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=rel)
        for o, w in zip(got.outputs, want.outputs):
            for key in ("logprobs", "elementwise_loss"):
                _close(o[key], w[key], f"run {i} {key}", rel)
        assert len(grads) == len(want_grads)
        for n, (g, w) in enumerate(zip(grads, want_grads)):
            _close(g, w, f"run {i} gradient {n}", rel)


def test_pick_takes_one_datum_per_run_in_turn_within_the_budget():
    model = _model("qwen3")
    a, b = (TrainingRun(model, RunConfig(rank=2)) for _ in range(2))
    pa = a.start([_datum(4, "cross_entropy", s) for s in range(4)], "cross_entropy")
    pb = b.start([_datum(6, "cross_entropy", s) for s in range(4)], "cross_entropy")
    assert [len(ds) for _, ds in pick([pa, pb], 16)] == [2, 1]  # 4 + 6 + 4, then neither 6 nor 4 fits
    assert [len(ds) for _, ds in pick([pb, pa], 10)] == [1, 1]


def test_a_diverging_run_fails_alone(one_torch_thread):
    model = _model("qwen3").float()
    runs = _runs(model)[:2]
    bad = _datum(6, "importance_sampling", 1)
    bad.inputs["advantages"][2] = float("inf")
    good = runs[0].start(_data_of(0), LOSSES[0])
    diverging = runs[1].start([bad], "importance_sampling")
    failed = run_group(pick([good, diverging], 1000))
    assert list(failed) == [diverging] and isinstance(failed[diverging], TrainingError)
    assert good.done and not diverging.done and diverging.outputs == []
    _, grads = _result(good, runs[0])
    assert all(bool(torch.isfinite(g).all()) for g in grads) and runs[1].grads is None


def test_the_core_batches_the_passes_that_wait(demo_dense):
    core = TrainerCore(LLMEngine(_cfg(demo_dense)))
    for r in ("a", "b", "c"):
        core.create(r, RUN)
        core.begin(r, f"{r}#0", _data(2, 6), "cross_entropy", None, True, "default", 1.0)
    first = core.advance("a#0", 64)  # a's slice took b's and c's datums too: 6 x 6 tokens
    assert first is not None and all(core.passes[f"{r}#0"].done for r in "bc")
    again = {r: core.advance(f"{r}#0", 64) for r in "bc"}  # answered without running anything
    assert all(v is not None for v in again.values()) and core.passes == {}
    core.begin("a", "a#1", _data(2, 6), "cross_entropy", None, True, "default", 1.0)
    alone = core.advance("a#1", 64)["metrics"]["loss:sum"]  # the same pass (no step between), alone
    assert alone == pytest.approx(first["metrics"]["loss:sum"], rel=1e-5)
