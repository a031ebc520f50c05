"""optim_step equals torch.optim.Adam(W) on the same gradients; a diverging pass fails alone;
training state round-trips; the serving layout folds alpha/r; refusals name the problem."""
from __future__ import annotations

import pytest
import torch

from loraserve.catalog.layout import load_revision, save_revision
from loraserve.model.tiny import random_model, tiny_config
from loraserve.train.config import RunConfig, TrainingError
from loraserve.train.run import AdamParams, Datum, TrainingRun

CFG = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)


def _run(**kw) -> TrainingRun:
    return TrainingRun(random_model(tiny_config("qwen3", **CFG), seed=1), RunConfig(rank=2, alpha=4.0, seed=0, **kw))


def _sft(tokens: list[int], weights: list[float] | None = None) -> Datum:
    t = torch.tensor(tokens)
    w = torch.tensor(weights) if weights is not None else torch.ones(len(tokens) - 1)
    return Datum(t[:-1], {"target_tokens": t[1:], "weights": w})


def _fb(run: TrainingRun, data, loss="cross_entropy", **kw):
    p = run.start(data, loss, **kw)
    p.advance(10_000)
    return p.finish()


@pytest.mark.parametrize("adam", [AdamParams(learning_rate=1e-2), AdamParams(
    learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1)])
def test_optim_step_equals_torch_adam(adam, one_torch_thread):
    run = _run()
    params = [p.detach().clone().requires_grad_(True) for p in run.factors.parameters()]
    opt_cls = torch.optim.AdamW if adam.weight_decay else torch.optim.Adam
    kw = dict(weight_decay=adam.weight_decay) if adam.weight_decay else {}
    ref = opt_cls(params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, **kw)
    for step in range(3):
        _fb(run, [_sft([1, 5, 9, 20, 7]), _sft([3, 4, 5])])
        for p, g in zip(params, run.grads):
            p.grad = g.clone()
        ref.step()
        run.optim_step(adam)
        for mine, want in zip(run.factors.parameters(), params):
            assert torch.equal(mine.detach(), want.detach()), step
    assert run.grads is None and run.steps == 3


def test_grad_clip_scales_the_global_norm():
    run = _run()
    _fb(run, [_sft([1, 5, 9, 20, 7])])
    grads = [g.clone() for g in run.grads]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    metrics = run.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=float(norm) / 4))
    assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-6)
    state = run.optimizer.state[run.factors.parameters()[0]]
    assert torch.allclose(state["exp_avg"], 0.1 * grads[0] / 4, rtol=1e-5, atol=1e-12)


def test_diverging_pass_fails_alone_and_leaves_the_run():
    run = _run()
    _fb(run, [_sft([1, 2, 3])])
    before = [g.clone() for g in run.grads]
    bad = _sft([1, 2, 3], [float("nan"), 1.0])
    with pytest.raises(TrainingError, match="loss of datum 0 is nan"):
        _fb(run, [bad])
    big = Datum(torch.tensor([1, 2]), {"target_tokens": torch.tensor([2, 3]), "logprobs": torch.tensor([-1e4, 0.0]),
                                       "advantages": torch.tensor([1.0, 1.0])})
    with pytest.raises(TrainingError, match="is -inf"):
        _fb(run, [big], loss="importance_sampling")
    assert all(torch.equal(a, b) for a, b in zip(run.grads, before))


def test_refusals_name_the_problem():
    run = _run()
    with pytest.raises(TrainingError, match="'dro' is not supported"):
        run.start([_sft([1, 2])], "dro")
    with pytest.raises(TrainingError, match="lacks \\['weights'\\]"):
        run.start([Datum(torch.tensor([1]), {"target_tokens": torch.tensor([2])})], "cross_entropy")
    with pytest.raises(TrainingError, match="outside the vocabulary"):
        run.start([_sft([1, 2, 9999])], "cross_entropy")
    with pytest.raises(TrainingError, match="not parameters of 'ppo'"):
        run.start([_sft([1, 2])], "ppo", {"beta": 1.0})
    with pytest.raises(TrainingError, match="nothing to train"):
        RunConfig(train_attn=False, train_mlp=False, train_unembed=False)


def test_a_moe_run_trains_each_layers_experts_or_dense_mlp():
    cfg = tiny_config("qwen3_moe", **CFG, mlp_only_layers=[1])
    run = TrainingRun(random_model(cfg), RunConfig(rank=2, seed=0))
    assert run.factors.kinds == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                 "experts.gate_proj", "experts.up_proj", "experts.down_proj", "lm_head"]
    paths = list(run.factors.pairs)
    assert "layers.0.mlp.experts.up_proj" in paths and "layers.0.mlp.up_proj" not in paths
    assert "layers.1.mlp.up_proj" in paths and "layers.1.mlp.experts.up_proj" not in paths
    a, b = run.factors.pairs["layers.0.mlp.experts.down_proj"]
    assert a.shape == (cfg.num_experts, 2, cfg.moe_intermediate_size) and b.shape == (cfg.num_experts, cfg.hidden_size, 2)
    assert not bool(b.any())  # PEFT's init: B zero


def test_state_round_trips_and_serving_layout_folds_scale(one_torch_thread):
    run = _run(train_mlp=False)
    for _ in range(2):
        _fb(run, [_sft([1, 5, 9, 20, 7])])
        run.optim_step(AdamParams(learning_rate=1e-2))
    state = {k: v.clone() for k, v in run.state_tensors().items()}
    other = _run(train_mlp=False)
    other.load_state(state, run.steps)
    for r in (run, other):
        _fb(r, [_sft([2, 6, 10])])
        r.optim_step(AdamParams(learning_rate=1e-2))
    for a, b in zip(run.factors.parameters(), other.factors.parameters()):
        assert torch.equal(a, b)
    weights = load_revision(save_revision(run.factors.serving_weights("fp", torch.float32, "train:t")))
    assert weights.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"] and weights.rank == 2
    a, b = run.factors.pairs["layers.1.self_attn.o_proj"]
    assert torch.equal(weights.tensors["layers.1.self_attn.o_proj.lora_A"], a.detach())
    assert torch.allclose(weights.tensors["layers.1.self_attn.o_proj.lora_B"], b.detach() * 2.0)
