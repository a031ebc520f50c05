"""A datum longer than the slice budget runs in chunks (train/chunked.py): its loss, logprobs and
every LoRA gradient equal the unsplit pass's (1e-5 relative) for each loss, dense, tied Llama on
prepacked linears, and a sliding window; one chunk per slice; its peak memory stays near one
chunk's while the unsplit pass's grows with the length; a non-finite loss fails before any backward."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from loraserve.model.prepack import can_prepack, prepack_linears
from loraserve.model.tiny import random_model, tiny_config
from loraserve.train.config import RunConfig, TrainingError
from loraserve.train.run import Datum, TrainingRun

DIMS = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
# float64 bases: the split and unsplit passes then differ by rounding only, far below 1e-5; the
# prepacked (oneDNN, float32 only) case rounds differently per chunk size, ~1e-5 (as the unsplit
# pass does against PEFT), and is held to 3e-5
MODELS = {"qwen3": ("qwen3", {}), "llama": ("llama", dict(tie_word_embeddings=True)),
          "mistral_window": ("mistral", dict(sliding_window=5)), "qwen3_packed": ("qwen3", {})}
INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
          "ppo": ("logprobs", "advantages")}


def _model(name: str):
    arch, extra = MODELS[name]
    model = random_model(tiny_config(arch, **DIMS, **extra), seed=1)
    if not name.endswith("packed"):
        return model.to(torch.float64)
    assert can_prepack(torch.device("cpu"), torch.float32)
    assert prepack_linears(model, batch_hint=8) > 0
    return model


def _run(model) -> TrainingRun:
    run = TrainingRun(model, RunConfig(rank=2, alpha=4.0, seed=0))
    g = torch.Generator().manual_seed(7)
    dtype = model.lm_head.weight.dtype
    with torch.no_grad():  # B is zero at init (every A gradient zero): draw both
        for t in run.factors.named_tensors().values():
            t.data = (torch.randn(t.shape, generator=g) * 0.3).to(dtype)
    return run


def _datum(n: int, loss: str, seed: int, vocab: int = 259) -> Datum:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (n + 1,), generator=g)
    values = {"weights": torch.rand(n, generator=g), "logprobs": -torch.rand(n, generator=g) * 6,
              "advantages": torch.randn(n, generator=g)}
    return Datum(toks[:-1], {"target_tokens": toks[1:], **{k: values[k] for k in INPUTS[loss]}})


def _drain(p, budget: int) -> int:
    """Advance the pass to its end; the number of slices it took."""
    calls = 1
    while not p.advance(budget):
        calls += 1
    return calls


def _pass(run: TrainingRun, data, loss: str, budget: int):
    p = run.start(data, loss)
    calls = _drain(p, budget)
    result, grads = p.finish(), run.grads
    run.grads = None
    return result, grads, calls


def _close(got, want, what, rel=1e-5):
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.2e}"


def _near_sampler(run: TrainingRun, data: list[Datum]) -> list[Datum]:
    """The datums with sampler logprobs near the learner's (ratios near 1, some PPO-clipped), as
    an RL loop sends them."""
    if "logprobs" not in data[0].inputs:
        return data
    p = run.start(data, "importance_sampling", backward=False)
    _drain(p, 1000)
    g = torch.Generator().manual_seed(5)
    return [Datum(d.tokens, {**d.inputs, "logprobs": out["logprobs"] + 0.3 * torch.randn(d.num_tokens, generator=g)})
            for d, out in zip(data, p.finish().outputs)]


@pytest.mark.parametrize("name", list(MODELS))
def test_split_datum_equals_unsplit(name, one_torch_thread):
    run, rel = _run(_model(name)), 3e-5 if name.endswith("packed") else 1e-5
    for loss in INPUTS:
        data = _near_sampler(run, [_datum(4, loss, 1), _datum(30, loss, 2), _datum(3, loss, 3)])
        whole, whole_grads, _ = _pass(run, data, loss, budget=64)
        split, split_grads, calls = _pass(run, data, loss, budget=7)
        assert calls >= 1 + 5 + 15  # 30 tokens: 5 forward chunks of 7, 15 backward chunks of 2
        # rel: the packed layers' sums depend on the batch's row count (a whole slice batches its datums)
        assert split.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=rel)
        for got, want in zip(split.outputs, whole.outputs):
            for key in ("logprobs", "elementwise_loss"):
                _close(got[key], want[key], f"{loss} {key}", rel)
        for n, (got, want) in enumerate(zip(split_grads, whole_grads)):
            _close(got, want, f"{loss} gradient {n}", rel)


def _peak_bytes(fn) -> int:
    """Peak CPU bytes torch's allocator held over `fn` (the profiler's allocation events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def test_peak_memory_of_a_long_datum_stays_near_one_chunk(one_torch_thread):
    model = random_model(tiny_config("qwen3", **{**DIMS, "intermediate_size": 256}, vocab_size=2048), seed=1)
    run = _run(model)

    def peak(n: int, budget: int) -> int:
        p = run.start([_datum(n, "cross_entropy", n, vocab=2048)], "cross_entropy")
        out = _peak_bytes(lambda: _drain(p, budget))
        run.grads = None
        return out

    short, long_split, long_whole = peak(64, 64), peak(192, 64), peak(192, 1024)
    assert long_whole > 2.5 * short   # unsplit: activations grow with the length (3x here)
    assert long_split < 1.5 * short   # split: one chunk's (+ a few KB per token of keys/values)
    assert long_split < long_whole / 3


def test_a_long_datum_with_a_non_finite_loss_fails_before_any_backward():
    run = _run(_model("qwen3"))
    bad = _datum(20, "cross_entropy", 1)
    bad.inputs["weights"][13] = float("nan")
    p = run.start([bad], "cross_entropy")
    with pytest.raises(TrainingError, match="loss of datum 0 is nan"):
        _drain(p, 6)
    assert p.chunked.backward_next == len(p.chunked.back_bounds) - 1 and run.grads is None
