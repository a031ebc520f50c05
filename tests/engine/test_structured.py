"""Structured output in the engine core (issue 23): the grammar spec on SamplingParams and the
engine-core wire, xgrammar's tokenizer info from the byte-level demo vocabulary, the compiled-
grammar LRU, the sampler's mask (constrained rows only; free rows and logprobs untouched), and
each kind end to end on the tiny demo base, greedy and seeded."""
from __future__ import annotations

import json
import re

import pytest
import torch

from loraserve.engine.core import sampler
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.sampler import sample, token_logprobs
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.core.structured import GrammarEngine, check_spec
from loraserve.engine.types import EngineError, GenerateRequest, GrammarSpec, SamplingParams
from loraserve.engine.wire import pack, request_from_wire, request_to_wire, unpack

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]})
SPECS = {
    "json_object": (GrammarSpec("json_object", ""), lambda t: isinstance(json.loads(t), (dict, list))),
    "json_schema": (GrammarSpec("json_schema", SCHEMA),
                    lambda t: type(json.loads(t).get("a")) is int),
    "choice": (GrammarSpec("choice", json.dumps(["yes", "no"])), lambda t: t in ("yes", "no")),
    "regex": (GrammarSpec("regex", "[0-9]{3}"), lambda t: re.fullmatch("[0-9]{3}", t)),
    "grammar": (GrammarSpec("grammar", 'root ::= "a" [b-d]{1,5} "e"'),
                lambda t: re.fullmatch("a[b-d]{1,5}e", t)),
}


@pytest.fixture(scope="module")
def engine(demo_dense) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                  max_model_len=256))


def test_spec_travels_on_the_wire_and_is_checked() -> None:
    spec = GrammarSpec("regex", "[0-9]{3}", "guided_regex")
    req = GenerateRequest("r", [1, 2], SamplingParams(structured=spec))
    assert req.params.adjusts_logits  # a constrained sequence takes the adjusting path
    for resolved in (False, True):  # the engine core's "add", a Ray Serve replica's request
        back = request_from_wire(unpack(pack([request_to_wire(req, resolved)]))[0])
        assert back.params.structured == spec and isinstance(back.params.structured, GrammarSpec)
    assert SamplingParams().structured is None and not SamplingParams().adjusts_logits
    with pytest.raises(EngineError):
        SamplingParams(structured=GrammarSpec("xml", ""))
    with pytest.raises(EngineError) as err:
        check_spec(GrammarSpec("regex", "[0-9", "guided_regex"))
    assert err.value.param == "guided_regex"
    with pytest.raises(EngineError) as err:
        check_spec(GrammarSpec("json_schema", '{"type": "nope"}', "guided_json"))
    assert err.value.param == "guided_json"


def test_tokenizer_info_and_the_lru(engine: LLMEngine) -> None:
    import xgrammar as xgr

    g = GrammarEngine(engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids,
                      cache_size=2)
    assert g.info.vocab_type == xgr.VocabType.BYTE_LEVEL and g.info.vocab_size == engine.vocab_size
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = g.compile(a)
    assert g.compile(a) is first and g.compiles == 1
    g.compile(b), g.compile(c)  # a is evicted (capacity 2)
    assert g.compiles == 3 and g.compile(a) is not first and g.compiles == 4


def test_mask_touches_constrained_rows_only_and_logprobs_stay_raw(engine: LLMEngine) -> None:
    torch.manual_seed(0)
    vocab = engine.vocab_size
    logits = torch.randn(3, vocab)
    raw = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0,
                                                            structured=SPECS["regex"][0]),
              SamplingParams(temperature=1.0, seed=1)]
    seqs = [Sequence(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    seqs[1].matcher = engine.grammars.matcher(params[1].structured)
    seqs[2].generator = torch.Generator().manual_seed(1)
    tokens = sample(logits, seqs, torch.Generator().manual_seed(0), engine.output.eos)
    assert torch.equal(logits, raw)  # the sampler never writes into the logits
    assert chr(int(tokens[1])) in "0123456789"
    alone = [sample(raw[i:i + 1], [s], torch.Generator().manual_seed(0), engine.output.eos)
             for i, s in enumerate(seqs) if i != 1]
    seqs[2].generator = torch.Generator().manual_seed(1)
    again = sample(raw, seqs, torch.Generator().manual_seed(0), engine.output.eos)
    assert int(again[0]) == int(alone[0]) == int(raw[0].argmax())
    lp = token_logprobs(raw, tokens, [0, 0, 0])[1]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(raw[1], -1)[tokens[1]]))


def test_a_free_batch_never_masks(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args):
        raise AssertionError("masked a free batch")

    monkeypatch.setattr(sampler, "grammar_mask", boom)
    out = engine.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=4, temperature=0),
                                            SamplingParams(max_tokens=4, min_p=0.1, seed=2)])
    assert all(len(o) == 4 or o[-1] in engine.output.eos for o in out)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_each_kind_end_to_end_in_one_batch(engine: LLMEngine, temperature: float) -> None:
    tok = engine.tokenizer
    # json_object sampled freely wanders into long strings: greedy only
    kinds = [k for k in SPECS if temperature == 0 or k != "json_object"]
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=11,
                             structured=SPECS[k][0]) for k in kinds]
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompt = tok.encode("say: ")
    solo = engine.generate([prompt], free)[0]
    outs = engine.generate([prompt] * (len(kinds) + 1), [*params, free])
    assert outs[-1] == solo  # the free neighbour is unaffected
    for kind, ids in zip(kinds, outs):
        assert ids[-1] in engine.output.eos, (kind, ids)  # finished "stop", on EOS
        assert SPECS[kind][1](tok.decode(ids)), (kind, tok.decode(ids))


def test_a_grammar_the_engine_cannot_compile_fails_that_request(engine: LLMEngine) -> None:
    bad = GenerateRequest("bad", [1, 2], SamplingParams(
        structured=GrammarSpec("grammar", "root ::= (", "guided_grammar")))
    with pytest.raises(EngineError) as err:
        engine.make_sequence(bad)
    assert err.value.param == "guided_grammar" and err.value.status == 400


def test_min_tokens_never_leaves_a_constrained_row_nothing(engine: LLMEngine) -> None:
    """"yes"/"no" is complete after 2-3 tokens; min_tokens 8 must not mask the only way out."""
    p = SamplingParams(max_tokens=16, temperature=0, min_tokens=8,
                       structured=SPECS["choice"][0])
    ids = engine.generate([[5, 6]], p)[0]
    assert engine.tokenizer.decode(ids) in ("yes", "no") and ids[-1] in engine.output.eos


def test_through_the_engine_core_process(demo_dense) -> None:
    """The spec crosses the process boundary; a grammar the core cannot compile fails that
    request alone, as a 400 naming its field."""
    import asyncio

    from loraserve.engine.client.core_client import CoreClient

    cfg = EngineConfig(model_dir=str(demo_dense), device="cpu", max_model_len=128,
                       max_batch_size=4, torch_threads=1)

    async def collect(client, req):
        ids = []
        async for out in client.generate(req):
            ids += out.token_ids
        return ids

    async def run():
        client = CoreClient(cfg)
        try:
            good = GenerateRequest("g", [5, 6], SamplingParams(
                max_tokens=32, temperature=1.0, seed=2, structured=SPECS["regex"][0]))
            bad = GenerateRequest("b", [5, 6], SamplingParams(
                structured=GrammarSpec("grammar", "root ::= (", "guided_grammar")))
            return await asyncio.gather(collect(client, good), collect(client, bad),
                                        return_exceptions=True)
        finally:
            await client.shutdown()

    ids, err = asyncio.run(run())
    text = "".join(chr(t) for t in ids if t < 256)
    assert re.fullmatch("[0-9]{3}", text) and ids[-1] >= 256, ids
    assert isinstance(err, EngineError) and err.param == "guided_grammar" and err.status == 400
