"""vLLM's sampling extensions in the sampler (issue 23): each one against a plain reference
implementation of its definition, per sequence, and a batch mixing sequences with and without
them giving each sequence exactly what it gets alone (hypothesis). Also: SamplingParams' ranges,
the fields travelling over the engine-core wire, min_tokens in the core's stop decision and in
the API side's stop strings, and the raw logits left as they were (logprobs are the model's).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraserve.engine.core import sampler
from loraserve.engine.core.output import TokenOutputs
from loraserve.engine.client.output_processor import OutputProcessor
from loraserve.engine.core.sampler import adjust_logits, sample
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.types import (EngineError, GenerateRequest, SamplingParams, TokenLogprob)
from loraserve.engine.wire import pack, request_from_wire, request_to_wire, unpack

V = 40
EOS = 39


def seq(params: SamplingParams, prompt: list[int] = (1, 2), output: list[int] = (),
        seed: int | None = None) -> Sequence:
    s = Sequence("r", list(prompt), params,
                 generator=None if seed is None else torch.Generator().manual_seed(seed))
    s.output_ids = list(output)
    return s


# -- reference implementations: one sequence, one token at a time -----------------------------------

def reference(logits: list[float], s: Sequence, eos: list[int]) -> list[float]:
    """vLLM's order: min_tokens, logit_bias, repetition, frequency, presence."""
    p, out = s.params, list(logits)
    if len(s.output_ids) < p.min_tokens:
        for t in (p.stop_token_ids if p.ignore_eos else [*eos, *p.stop_token_ids]):
            out[t] = -math.inf
    for t, b in p.logit_bias.items():
        out[t] += b
    seen = set(s.prompt_ids) | set(s.output_ids)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = s.output_ids.count(t)
        out[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


def test_no_extension_no_adjustment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch where nobody asks for an extension never builds anything for them."""
    assert not SamplingParams().adjusts_logits
    monkeypatch.setattr(sampler, "adjust_logits", lambda *a: pytest.fail("adjusted"))
    logits = torch.randn(3, V)
    seqs = [seq(SamplingParams(temperature=0)), seq(SamplingParams(seed=1), seed=1),
            seq(SamplingParams(top_k=3, top_p=0.5), seed=2)]
    assert sample(logits, seqs, torch.Generator(), [EOS]).shape == (3,)


@pytest.mark.parametrize("params,output", [
    (SamplingParams(logit_bias={3: 100.0, 7: -100.0, 0: 0.5}), []),
    (SamplingParams(min_tokens=3, stop_token_ids=[5, 6]), [1, 1]),
    (SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True), [1]),
    (SamplingParams(min_tokens=2, stop_token_ids=[5]), [1, 1]),  # reached: nothing masked
    (SamplingParams(repetition_penalty=1.7), [4, 4, 9]),
    (SamplingParams(repetition_penalty=0.3), [4, 9]),
    (SamplingParams(presence_penalty=1.5), [4, 4, 9]),
    (SamplingParams(frequency_penalty=-0.7), [4, 4, 4, 9, 2]),
    (SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25,
                    logit_bias={2: 3.0}, min_tokens=8, stop_token_ids=[1]), [2, 2, 8]),
])
def test_each_extension_matches_its_definition(params: SamplingParams, output: list[int]) -> None:
    logits = torch.randn(1, V) * 3
    s = seq(params, prompt=[2, 3, 4, 20], output=output)
    got = adjust_logits(logits, [s], [EOS])[0].tolist()
    assert got == pytest.approx(reference(logits[0].tolist(), s, [EOS]), rel=1e-6, abs=1e-6)


def test_penalties_see_prompt_only_for_repetition() -> None:
    logits = torch.full((1, V), 2.0)
    prompt_only = seq(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), prompt=[5])
    assert adjust_logits(logits, [prompt_only])[0, 5] == 2.0  # OpenAI: output tokens only
    rep = seq(SamplingParams(repetition_penalty=2.0), prompt=[5])
    assert adjust_logits(logits, [rep])[0, 5] == 1.0 and adjust_logits(logits, [rep])[0, 6] == 2.0


def test_logit_bias_decides_greedy_and_logits_are_not_written() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    seqs = [seq(SamplingParams(temperature=0, logit_bias={11: 100.0})),
            seq(SamplingParams(temperature=0))]
    assert sample(logits, seqs, torch.Generator(), [EOS]).tolist() == [11, int(before[1].argmax())]
    assert torch.equal(logits, before)  # the logprobs are computed from these: raw


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 5] = 10.0, 9.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], max_tokens=4)
    picks = [sample(logits, [seq(params, output=[1] * n)], torch.Generator(), [EOS]).item()
             for n in range(4)]
    assert picks[0] not in (EOS, 5) and picks[1] not in (EOS, 5) and picks[2:] == [EOS, EOS]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    assert sample(logits, [seq(ignoring)], torch.Generator(), [EOS]).item() == EOS


def test_min_p() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    for s in range(50):
        greedy_like = seq(SamplingParams(temperature=1.0, min_p=1.0), seed=s)
        assert sample(logits, [greedy_like], torch.Generator()).item() == 0
        half = seq(SamplingParams(temperature=1.0, min_p=0.5), seed=s)
        assert sample(logits, [half], torch.Generator()).item() in (0, 1)  # p >= 0.2
    drawn = {sample(logits, [seq(SamplingParams(temperature=1.0, min_p=0.3), seed=s)],
                    torch.Generator()).item() for s in range(200)}
    assert drawn == {0, 1, 2}  # 0.15 >= 0.3 * 0.4 is kept, 0.1 is not


# -- batches: each sequence gets what it gets alone -----------------------------------------------

@st.composite
def _params(draw) -> SamplingParams:
    ext = draw(st.booleans())
    kw = dict(temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])),
              top_k=draw(st.sampled_from([-1, -1, 1, 5])),
              top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.3])), max_tokens=12)
    if ext:
        kw.update(min_p=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
                  repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 1e6])),
                  presence_penalty=draw(st.floats(-2, 2)),
                  frequency_penalty=draw(st.floats(-2, 2)),
                  logit_bias=draw(st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100),
                                                  max_size=4)),
                  min_tokens=draw(st.integers(0, 6)),
                  stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=2)),
                  ignore_eos=draw(st.booleans()))
    return SamplingParams(**kw)


_row = st.tuples(_params(), st.lists(st.integers(0, V - 1), min_size=1, max_size=8),
                 st.lists(st.integers(0, V - 1), max_size=8), st.integers(0, 2**32))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_row, min_size=1, max_size=6), scale=st.sampled_from([0.1, 1.0, 5.0]),
       logit_seed=st.integers(0, 2**16))
def test_a_mixed_batch_gives_each_sequence_what_it_gets_alone(rows, scale, logit_seed) -> None:
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(logit_seed)) * scale

    def fresh() -> list[Sequence]:  # new generators: each run draws from the seed's start
        return [seq(p, prompt, output, seed) for p, prompt, output, seed in rows]

    together = sample(logits, fresh(), torch.Generator(), [EOS]).tolist()
    alone = [sample(logits[i:i + 1], [s], torch.Generator(), [EOS]).item()
             for i, s in enumerate(fresh())]
    assert together == alone
    for (p, _, output, _), token in zip(rows, together):
        assert 0 <= token < V
        if len(output) < p.min_tokens:
            assert token not in p.stop_token_ids and (p.ignore_eos or token != EOS)


# -- ranges, the wire, the stop decisions ---------------------------------------------------------

@pytest.mark.parametrize("kw,param", [
    ({"min_p": 1.01}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
])
def test_out_of_range_is_refused_naming_the_field(kw: dict, param: str) -> None:
    with pytest.raises(EngineError) as err:
        SamplingParams(**kw)
    assert err.value.param == param and err.value.status == 400


def test_repetition_penalty_is_clamped_into_float32() -> None:
    assert SamplingParams(repetition_penalty=1e-300).repetition_penalty == 1e-30
    assert SamplingParams(repetition_penalty=1e300).repetition_penalty == 1e30
    logits = torch.tensor([[50.0, -50.0, 1.0, -1.0]])
    for rep in (1e-300, 1e300):
        s = seq(SamplingParams(repetition_penalty=rep, temperature=1e-5), prompt=[0, 1])
        assert torch.isfinite(adjust_logits(logits, [s])[0, :2]).all()
        assert sample(logits, [s], torch.Generator()).item() == (0 if rep < 1 else 2)


def test_extensions_travel_over_the_wire() -> None:
    params = SamplingParams(min_p=0.1, repetition_penalty=1.2, presence_penalty=-0.5,
                            frequency_penalty=0.7, logit_bias={3: -4.5, 17: 100.0}, min_tokens=2)
    req = GenerateRequest("w", [1, 2], params)
    back = request_from_wire(unpack(pack(["add", request_to_wire(req), None]))[1])
    assert back.params == params and back.params.logit_bias == {3: -4.5, 17: 100.0}


def test_core_does_not_stop_before_min_tokens() -> None:
    core = TokenOutputs([EOS], 4096)
    s = seq(SamplingParams(min_tokens=2, stop_token_ids=[5], max_tokens=10))
    for token in (EOS, 5):  # the sampler masks these; the core would not stop on them anyway
        core.append(s, token, None)
        assert s.finish_reason is None
    core.append(s, 5, None)
    assert s.finish_reason == "stop"


class _Chars:
    """A tokenizer whose token i is chr(i + 97)."""

    def detokenizer(self, skip_special_tokens: bool = True):
        class D:
            def step(self, token: int) -> str:
                return chr(token + 97)

            def flush(self) -> str:
                return ""
        return D()


@pytest.mark.parametrize("min_tokens,text,n_tokens", [(0, "", 1), (2, "xx", 3), (4, "xxxx", 5)])
def test_stop_strings_wait_for_min_tokens(min_tokens: int, text: str, n_tokens: int) -> None:
    proc = OutputProcessor(_Chars())
    proc.add(GenerateRequest("r", [1], SamplingParams(stop=["x"], min_tokens=min_tokens,
                                                      max_tokens=10)))
    got = []
    for k in range(10):
        out = proc.process([_delta("r", [23], k + 1)])[0]  # token 23 is "x"
        got += out
        if out and out[-1].finish_reason:
            break
    assert "".join(o.text for o in got) == text
    assert sum(len(o.token_ids) for o in got) == n_tokens and got[-1].finish_reason == "stop"


def _delta(rid: str, ids: list[int], n: int):
    from loraserve.engine.types import RequestOutput
    return RequestOutput(rid, ids, "", [TokenLogprob(t, -1.0, {}) for t in ids], None, None, 1, n)
