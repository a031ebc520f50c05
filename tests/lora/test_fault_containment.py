"""A fault while handling one sequence fails that sequence only.

A fault is injected for one request at each stage of the engine step (input preparation, the
model forward, the logits pass, prompt logprobs, sampling, token post-processing, the output
delta). That request must end with a 500 error of its own; every other request of the mixed
batch must finish with exactly the output of a run without the fault.
"""
from __future__ import annotations

import pytest

import loraserve.engine.core.llm_engine as llm_engine
from loraserve.engine.core.build import build_engine
from loraserve.engine.config import EngineConfig
from loraserve.engine.types import EngineError, GenerateRequest, SamplingParams

from .driving import drive

POISON = "r2"
ADAPTERS = ["t/qv-r4", None, "t/all-r8-rslora", "t/qv-r4", "t/o-head-r2", None]


def _engine(aset):
    return build_engine(EngineConfig(model_dir=str(aset.base), catalog_dir=str(aset.catalog), device="cpu",
                                     dtype="float32", max_model_len=64, max_batch_size=8,
                                     max_gpu_adapters=4, max_lora_rank=16, lora_backend="torch"))


def _requests(vocab: int) -> list[GenerateRequest]:
    reqs = []
    for i, adapter in enumerate(ADAPTERS):
        params = SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.8, seed=i,
                                logprobs=1 if i == 3 else None,
                                prompt_logprobs=0 if i in (2, 4) else None)
        prompt = [(7 * i + 3 * j) % vocab for j in range(4 + i)]
        reqs.append(GenerateRequest(f"r{i}", prompt, params, adapter))
    return reqs


def _poisoned(items) -> bool:
    return any(getattr(s, "request_id", None) == POISON for s in items)


def _inject(monkeypatch, eng, stage: str) -> None:
    """Make `stage` raise whenever it handles the poison request."""
    def boom():
        raise RuntimeError(f"injected fault in {stage}")

    runner, output = eng.runner, eng.output
    if stage in ("prepare", "logits"):
        real = getattr(runner, stage)

        def fake(seqs, *args):
            if _poisoned(seqs):
                boom()
            return real(seqs, *args)
        monkeypatch.setattr(runner, stage, fake)
    elif stage == "forward":
        real_fwd = runner.forward
        monkeypatch.setattr(runner, "forward",
                            lambda inputs: boom() if _poisoned(inputs.batch) else real_fwd(inputs))
    elif stage == "sample":
        real_sample = llm_engine.sample
        monkeypatch.setattr(llm_engine, "sample",
                            lambda rows, seqs, *rest, **kw: boom() if _poisoned(seqs)
                            else real_sample(rows, seqs, *rest, **kw))
    else:  # OutputProcessor methods that take the sequence first
        real_out = getattr(output, stage)

        def fake_out(seq, *args):
            if seq.request_id == POISON:
                boom()
            return real_out(seq, *args)
        monkeypatch.setattr(output, stage, fake_out)


@pytest.mark.parametrize("stage", ["prepare", "forward", "logits", "set_prompt_logprobs", "sample",
                                   "append", "delta"])
def test_fault_in_one_sequence_fails_only_it(dense_set, monkeypatch, stage) -> None:
    clean = drive(_engine(dense_set), _requests(1000))
    assert all(err is None and len(toks) == 5 for toks, err in clean.values())
    eng = _engine(dense_set)
    _inject(monkeypatch, eng, stage)
    got = drive(eng, _requests(1000))
    tokens, err = got[POISON]
    assert isinstance(err, EngineError) and err.status == 500 and POISON in str(err)
    for rid, result in got.items():
        if rid != POISON:
            assert result == clean[rid], f"{rid} changed when {POISON} failed in {stage}"
    assert eng.blocks.num_free == eng.blocks.num_blocks  # the failed sequence freed its KV blocks
    assert all(eng.adapters.pool.entry(k).refcount == 0 for k in eng.adapters.pool.resident())
    # and the engine goes on serving
    again = drive(eng, [GenerateRequest("after", [1, 2, 3], SamplingParams(max_tokens=2), "t/qv-r4")])
    assert again["after"][1] is None and len(again["after"][0]) == 2


def test_out_of_range_sampling_is_refused_before_the_batch(dense_set) -> None:
    """The poison of the original report (top_k = 2**63) never reaches a batch."""
    eng = _engine(dense_set)
    with pytest.raises(EngineError) as e:
        eng.validate(GenerateRequest("x", [1, 2], SamplingParams(max_tokens=2, top_k=2**63)))
    assert e.value.status == 400 and e.value.param == "top_k"
    for bad in (dict(temperature=float("nan")), dict(top_p=float("inf")), dict(seed=2**64),
                dict(stop=[""])):
        with pytest.raises(EngineError) as e:
            SamplingParams(**bad)
        assert e.value.status == 400 and e.value.param == next(iter(bad))
