"""Sampling parameters that underflow or overflow the sampler's float32 are refused or clamped.

Issue 22 row 8: `top_p: 1e-300` was accepted and underflowed to 0.0 in float32, so every token
was dropped and the request answered NUL tokens. A generator draws any parameters the API
accepts (extreme magnitudes, subnormals, values next to the bounds) over random logits, heavy
tailed ones included: the sampler always returns a token id of the vocabulary, the most likely
token wherever the parameters leave only one, and never a dropped one.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.engine.core.sampler import sample
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.types import EngineError, SamplingParams

VOCAB = 50


def _seq(params: SamplingParams, seed: int) -> Sequence:
    return Sequence("r", [1], params, None, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-38])
def test_underflowing_top_p_keeps_the_top_token(top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert params.top_p > 0 and float(torch.tensor(params.top_p, dtype=torch.float32)) > 0
    logits = torch.randn(3, VOCAB)
    tokens = sample(logits, [_seq(params, i) for i in range(3)], torch.Generator())
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_huge_temperature_is_uniform_not_nan():
    params = SamplingParams(temperature=1e300)
    assert math.isfinite(float(torch.tensor(params.temperature, dtype=torch.float32)))
    tokens = sample(torch.randn(4, VOCAB) * 1e30, [_seq(params, i) for i in range(4)], torch.Generator())
    assert all(0 <= t < VOCAB for t in tokens.tolist())


_extreme = st.one_of(st.floats(min_value=0, max_value=1e308, allow_nan=False),
                     st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-5, 1.0, 2.0, 1e38, 1e300]))


@settings(max_examples=200, deadline=None)
@given(temperature=_extreme, top_p=st.one_of(st.floats(0, 1), st.sampled_from([5e-324, 1e-300, 1e-45, 1.0])),
       top_k=st.integers(-1, 2 * VOCAB), scale=st.sampled_from([1e-30, 1e-3, 1.0, 30.0, 1e4, 1e30]),
       seed=st.integers(0, 2**32), heavy=st.booleans())
def test_any_accepted_parameters_sample_a_kept_token(temperature, top_p, top_k, scale, seed, heavy):
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except EngineError:
        return  # refused with a 400: nothing reaches a batch
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.distributions.StudentT(1.0).sample((2, VOCAB)) if heavy else torch.randn(2, VOCAB, generator=gen))
    logits = (logits * scale).clamp(-3e38, 3e38)
    tokens = sample(logits, [_seq(params, seed), _seq(SamplingParams(temperature=0), seed)], gen)
    assert all(0 <= t < VOCAB for t in tokens.tolist())
    assert tokens[1] == logits[1].argmax()  # the greedy neighbour is untouched
    if 0 < params.top_k <= VOCAB:
        assert tokens[0] in logits[0].topk(params.top_k).indices  # never a dropped token
