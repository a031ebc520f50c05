"""Detokenization and stop strings in the API process (`OutputProcessor`), the core token-only.

The core's token-id deltas run through the API side's processor must give exactly the deltas the
old in-core path gave (recorded below from it: multi-byte UTF-8 split across the demo's byte
tokens, stop strings spanning tokens, an incomplete character at the end), and a stop string must
end the request in the core too, freeing its KV blocks (the engine driven directly and the
in-process hosting here; the core-process hosting in test_core_process.py).
"""
from __future__ import annotations

import asyncio

import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.output import TokenOutputs
from loraserve.engine.client.output_processor import OutputProcessor
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.types import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from loraserve.tokenizer import Tokenizer

EOS = 258  # the demo tokenizer's <|im_end|>; its tokens 0-255 are bytes


def _b(text: str) -> list[int]:
    return list(text.encode())


SCENARIOS = {  # name -> (the tokens the model "samples", stop strings, stop token ids, max_tokens)
    "utf8_length": (_b("naïve café — 日本語 ok"), [], [], 27),
    "stop_multibyte": (_b("naïve café — 日本語 ok"), ["日本"], [], 64),
    "stop_earliest_of_two": (_b("naïve café — 日本語 ok"), ["ok", "é —"], [], 64),
    "stop_emoji": (_b("party 🎉🎉 time"), ["🎉"], [], 64),
    "length_mid_char": (_b("ab日本")[:-1], [], [], 7),
    "eos_mid_char": (_b("ab日")[:-1] + [EOS], [], [], 64),
    "stop_on_last_token": (_b("hello world"), ["world"], [], 11),
    "stop_token_id": (_b("hello world again"), [], [32], 64),
    "no_hit_held_back": (_b("abcabcab ü"), ["abd", "xyz!"], [], 11),
    "stop_in_prefix_of_other": (_b("xx<end>yy"), ["<end>", "x<e"], [], 64),
}

GOLDEN = {  # name -> the old in-core path's deltas: (token ids, text, finish reason, tokens so far)
    'utf8_length': [
        ([110], 'n', None, 1), ([97], 'a', None, 2), ([195], '', None, 3), ([175], 'ï', None, 4),
        ([118], 'v', None, 5), ([101], 'e', None, 6), ([32], ' ', None, 7), ([99], 'c', None, 8),
        ([97], 'a', None, 9), ([102], 'f', None, 10), ([195], '', None, 11),
        ([169], 'é', None, 12), ([32], ' ', None, 13), ([226], '', None, 14),
        ([128], '', None, 15), ([148], '—', None, 16), ([32], ' ', None, 17),
        ([230], '', None, 18), ([151], '', None, 19), ([165], '日', None, 20),
        ([230], '', None, 21), ([156], '', None, 22), ([172], '本', None, 23),
        ([232], '', None, 24), ([170], '', None, 25), ([158], '語', None, 26),
        ([32], ' ', 'length', 27),
    ],
    'stop_multibyte': [
        ([110], '', None, 1), ([97], 'n', None, 2), ([195], '', None, 3), ([175], 'a', None, 4),
        ([118], 'ï', None, 5), ([101], 'v', None, 6), ([32], 'e', None, 7), ([99], ' ', None, 8),
        ([97], 'c', None, 9), ([102], 'a', None, 10), ([195], '', None, 11),
        ([169], 'f', None, 12), ([32], 'é', None, 13), ([226], '', None, 14),
        ([128], '', None, 15), ([148], ' ', None, 16), ([32], '—', None, 17),
        ([230], '', None, 18), ([151], '', None, 19), ([165], ' ', None, 20),
        ([230], '', None, 21), ([156], '', None, 22), ([172], '', 'stop', 23),
    ],
    'stop_earliest_of_two': [
        ([110], '', None, 1), ([97], '', None, 2), ([195], '', None, 3), ([175], 'n', None, 4),
        ([118], 'a', None, 5), ([101], 'ï', None, 6), ([32], 'v', None, 7), ([99], 'e', None, 8),
        ([97], ' ', None, 9), ([102], 'c', None, 10), ([195], '', None, 11),
        ([169], 'a', None, 12), ([32], 'f', None, 13), ([226], '', None, 14),
        ([128], '', None, 15), ([148], '', 'stop', 16),
    ],
    'stop_emoji': [
        ([112], 'p', None, 1), ([97], 'a', None, 2), ([114], 'r', None, 3), ([116], 't', None, 4),
        ([121], 'y', None, 5), ([32], ' ', None, 6), ([240], '', None, 7), ([159], '', None, 8),
        ([142], '', None, 9), ([137], '', 'stop', 10),
    ],
    'length_mid_char': [
        ([97], 'a', None, 1), ([98], 'b', None, 2), ([230], '', None, 3), ([151], '', None, 4),
        ([165], '日', None, 5), ([230], '', None, 6), ([156], '�', 'length', 7),
    ],
    'eos_mid_char': [
        ([97], 'a', None, 1), ([98], 'b', None, 2), ([230], '', None, 3), ([151], '', None, 4),
        ([258], '', 'stop', 5),
    ],
    'stop_on_last_token': [
        ([104], '', None, 1), ([101], '', None, 2), ([108], '', None, 3), ([108], '', None, 4),
        ([111], 'h', None, 5), ([32], 'e', None, 6), ([119], 'l', None, 7), ([111], 'l', None, 8),
        ([114], 'o', None, 9), ([108], ' ', None, 10), ([100], '', 'stop', 11),
    ],
    'stop_token_id': [
        ([104], 'h', None, 1), ([101], 'e', None, 2), ([108], 'l', None, 3), ([108], 'l', None, 4),
        ([111], 'o', None, 5), ([32], '', 'stop', 6),
    ],
    'no_hit_held_back': [
        ([97], '', None, 1), ([98], '', None, 2), ([99], '', None, 3), ([97], 'a', None, 4),
        ([98], 'b', None, 5), ([99], 'c', None, 6), ([97], 'a', None, 7), ([98], 'b', None, 8),
        ([32], 'c', None, 9), ([195], '', None, 10), ([188], 'ab ü', 'length', 11),
    ],
    'stop_in_prefix_of_other': [
        ([120], '', None, 1), ([120], '', None, 2), ([60], '', None, 3), ([101], 'x', 'stop', 4),
    ],
}


@pytest.fixture(scope="module")
def tok(demo_dense) -> Tokenizer:
    return Tokenizer.from_dir(demo_dense)


def _params(name: str) -> SamplingParams:
    _, stop, stop_ids, max_tokens = SCENARIOS[name]
    return SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids, logprobs=0)


def _script(tok: Tokenizer, name: str, per_delta: int = 1, stream: bool = True):
    """Play SCENARIOS[name] through the core's TokenOutputs (`per_delta` tokens per delta) and
    the API side's processor, as the hostings do: the core stops when the processor says a stop
    string ended the request. -> the deltas the reader got."""
    ids = SCENARIOS[name][0]
    params = _params(name)
    core, proc = TokenOutputs([EOS, 256], 4096), OutputProcessor(tok)
    proc.add(GenerateRequest("r", [1, 2], params, stream=stream))
    seq = Sequence("r", [1, 2], params)
    got: list[RequestOutput] = []
    for i in range(0, len(ids), per_delta):
        for t in ids[i:i + per_delta]:
            if seq.finish_reason is None:
                core.append(seq, t, TokenLogprob(t, -1.0, {}))
        ready, ended = proc.process([core.delta(seq)])
        got += ready
        if ended or seq.finish_reason is not None:
            assert ended == ([] if seq.finish_reason is not None else ["r"])
            break
    return got


def _plain(outs: list[RequestOutput]) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.num_output_tokens) for o in outs]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_api_side_deltas_equal_the_old_in_core_path(tok, name) -> None:
    got = _script(tok, name)
    assert _plain(got) == GOLDEN[name]
    assert all(len(o.logprobs) == len(o.token_ids) for o in got)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_multi_token_and_non_streamed_deltas_give_the_same_answer(tok, name) -> None:
    """Deltas of several tokens (a stop string may end the request mid-delta: the tokens after
    it are cut, with their logprobs) and a non-streamed request (first delta, then one merged)
    add up to the same tokens, text and finish as one token per delta."""
    want = GOLDEN[name]
    ids, text = [t for d in want for t in d[0]], "".join(d[1] for d in want)
    for per_delta, stream in ((3, True), (1, False), (4, False)):
        got = _script(tok, name, per_delta, stream)
        assert [t for o in got for t in o.token_ids] == ids
        assert [lp.token_id for o in got for lp in o.logprobs] == ids
        assert "".join(o.text for o in got) == text
        assert (got[-1].finish_reason, got[-1].num_output_tokens) == want[-1][2:]
        if not stream:
            assert len(got) == min(2, -(-len(ids) // per_delta))
            assert len(got[0].token_ids) == min(per_delta, len(ids))


def test_tokens_after_a_stop_string_are_dropped_and_unknown_requests_ignored(tok) -> None:
    proc = OutputProcessor(tok)
    proc.add(GenerateRequest("r", [1], SamplingParams(max_tokens=9, stop=["c"])))
    ready, ended = proc.process([RequestOutput("r", _b("abcd"), "", num_output_tokens=4),
                                 RequestOutput("r", _b("e"), "", num_output_tokens=5),
                                 RequestOutput("gone", _b("x"), "", num_output_tokens=1)])
    assert _plain(ready) == [(_b("abc"), "ab", "stop", 3)] and ended == ["r"]
    proc.add(GenerateRequest("e", [1], SamplingParams(max_tokens=9, stop=["zz"])))
    err = RuntimeError("boom")
    ready, ended = proc.process([RequestOutput("e", _b("ab"), ""),
                                 RequestOutput("e", [], "", finish_reason="error", error=err)])
    assert [o.text for o in ready] == ["a", ""] and ready[1].error is err and ended == []


def _drive(eng: LLMEngine, reqs: list[GenerateRequest]) -> dict[str, list[RequestOutput]]:
    """Step eng with reqs through an OutputProcessor, aborting in eng what a stop string ended
    (what the hostings do, here synchronously)."""
    proc = OutputProcessor(eng.tokenizer)
    got: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        proc.add(r)
        eng.add_request(r)
    while eng.has_work():
        ready, ended = proc.process(eng.step())
        for out in ready:
            got[out.request_id].append(out)
        for rid in ended:
            eng.abort(rid)
    return got


def _ascii_stop(text: str) -> str:
    """A stop string from the demo base's (random, mostly not UTF-8) output: its first printable
    ASCII character after the start, which no incomplete multi-byte tail can hide."""
    return next(c for c in text[3:] if c.isascii() and c.isprintable())


def test_a_stop_string_ends_the_request_in_the_core(demo_dense) -> None:
    eng = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                 max_model_len=128))
    prompt = eng.tokenizer.encode("Who are you?")
    free = eng.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    text = eng.tokenizer.decode(free)
    stop = _ascii_stop(text)
    cut = next(n for n in range(1, 41) if stop in eng.tokenizer.decode(free[:n]))  # tokens to it
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, stop=[stop])
    reqs = [GenerateRequest("stop", prompt, params),
            GenerateRequest("free", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))]
    seqs = {}
    make = eng.make_sequence
    eng.make_sequence = lambda req, rec=None: seqs.setdefault(req.request_id, make(req, rec))
    got = _drive(eng, reqs)
    stopped, full = got["stop"], got["free"]
    assert "".join(o.text for o in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].num_output_tokens == cut
    assert [t for o in stopped for t in o.token_ids] == free[:cut]
    assert "".join(o.text for o in full) == text and full[-1].finish_reason == "length"
    # in the core: aborted right after the token that completed the stop string, blocks freed
    assert seqs["stop"].finish_reason == "abort" and len(seqs["stop"].output_ids) == cut
    assert not eng.seqs and eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.snapshot.running == 0 and eng.snapshot.kv_usage == 0


def test_a_stop_string_ends_the_request_in_the_in_process_engine(demo_dense) -> None:
    eng = AsyncEngine(LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                             max_model_len=256)))
    prompt = eng.tokenizer.encode("Who are you?")
    free = eng.transport.engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    text = eng.tokenizer.decode(free)
    stop = _ascii_stop(text)
    seqs: list[Sequence] = []
    make = eng.transport.engine.make_sequence
    eng.transport.engine.make_sequence = lambda req, rec=None: seqs.append(make(req, rec)) or seqs[-1]

    async def run():
        try:
            outs = [o async for o in eng.generate(GenerateRequest("s", prompt, SamplingParams(
                max_tokens=200, temperature=0.0, ignore_eos=True, stop=[stop]), stream=False))]
            for _ in range(500):  # the abort reaches the engine thread
                if not eng.transport.engine.seqs and eng.snapshot.running == 0:
                    break
                await asyncio.sleep(0.01)
            return outs
        finally:
            await eng.shutdown()

    outs = asyncio.run(run())
    assert "".join(o.text for o in outs) == text[: text.index(stop)] and outs[-1].finish_reason == "stop"
    assert seqs[0].finish_reason == "abort" and len(seqs[0].output_ids) < 200
    assert not eng.transport.engine.seqs and eng.transport.engine.blocks.num_free == eng.transport.engine.blocks.num_blocks
    assert eng.snapshot.running == 0 and eng.snapshot.kv_usage == 0
