"""The engine's screen of a step's logits and its greedy pick (`LLMEngine._screen`, `_sample`).

On the CPU the screen reads the logits once (`cpu_fused.screen_logits`): a row holding NaN or
Inf fails its sequence alone, and each row's argmax is kept for `_sample`, which hands it out
for a batch whose every sequence is plain greedy (temperature 0, no logits adjusted, no
logprobs) instead of calling the sampler. A generator draws batches mixing plain greedy,
adjusted, logprob and sampling requests, with NaN/Inf rows and tied maxima, and holds the
tokens each sequence gets, and which sequences fail, equal to the torch path's (the screen as a
sum, every token from `sampler.sample`)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.engine.core import llm_engine
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.model_runner import StepResult
from loraserve.engine.core.output import TokenOutputs
from loraserve.engine.core.sampler import sample as real_sample
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.types import SamplingParams
from loraserve.kernels import cpu_fused

V = 50

PARAMS = st.sampled_from([
    SamplingParams(temperature=0.0, max_tokens=4),                       # plain greedy
    SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),           # greedy, logprobs read
    SamplingParams(temperature=0.0, max_tokens=4, logit_bias={3: 5.0}),  # greedy, adjusted
    SamplingParams(temperature=0.8, max_tokens=4, seed=7),               # sampled
])


def _engine() -> SimpleNamespace:
    """What `_screen` and `_sample` read of an engine, its own methods bound to it."""
    eng = SimpleNamespace(seqs={}, default_gen=torch.Generator().manual_seed(0),
                          output=TokenOutputs([V - 1], 64), failed=[])
    for name in ("_screen", "_sample", "_pick", "_contained"):
        setattr(eng, name, getattr(LLMEngine, name).__get__(eng))
    eng._fail_non_finite = lambda seq, outs: eng.failed.append(seq.request_id)
    return eng


def _run(fused: bool, logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list, list]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_fused, "screens", lambda x: fused and cpu_fused.available())
        return _step(logits, params)


def _step(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list, list]:
    eng = _engine()
    seqs = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", [1, 2], p, generator=None if p.seed is None else torch.Generator().manual_seed(p.seed))
        s.num_cached = len(s)  # the step computed its tokens (`_advance`): it samples
        eng.seqs[s.request_id] = s
        seqs.append(s)
    outs: list = []
    kept, result = eng._screen(seqs, StepResult(False, logits.clone(), {}), outs)
    eng._sample(kept, result, outs)
    assert all(len(s.output_ids) == 1 for s in kept)
    return [(s.request_id, s.output_ids) for s in seqs], sorted(eng.failed)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(params=st.lists(PARAMS, min_size=1, max_size=5), bad=st.lists(st.sampled_from(
    [float("nan"), float("inf"), -float("inf")]), max_size=2), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_the_screen_and_pick_give_each_sequence_what_the_torch_path_gives(params, bad, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), V, generator=gen)
    if ties:
        logits = logits.round()
    for j, value in enumerate(bad):
        logits[j % len(params), (7 * j) % V] = value
    logging.disable(logging.ERROR)
    try:
        assert _run(True, logits, params) == _run(False, logits, params)
    finally:
        logging.disable(logging.NOTSET)


def test_a_plain_greedy_batch_is_picked_by_the_screen_without_the_sampler(monkeypatch):
    """With the fused ops (every machine with a C++ compiler) a plain greedy batch never calls
    the sampler; without them the sampler picks. Either way the NaN row fails alone and the
    others get their argmax."""
    calls = []
    monkeypatch.setattr(llm_engine, "sample", lambda *a, **k: calls.append(1) or real_sample(*a, **k))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    logits[1, 4] = float("nan")
    eng = _engine()
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=0.0, max_tokens=2)) for i in range(3)]
    for s in seqs:
        s.num_cached = len(s)
        eng.seqs[s.request_id] = s
    kept, result = eng._screen(seqs, StepResult(False, logits, {}), [])
    assert eng.failed == ["r1"] and [s.request_id for s in kept] == ["r0", "r2"]
    assert (result.picked is not None) == cpu_fused.available()
    eng._sample(kept, result, [])
    assert [s.output_ids for s in seqs] == [[int(logits[0].argmax())], [], [int(logits[2].argmax())]]
    assert calls == ([] if cpu_fused.available() else [1])
