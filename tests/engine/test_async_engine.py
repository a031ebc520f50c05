"""AsyncEngine delivery: streamed requests get one delta per step; non-streamed ones get their
first delta, then one merged delta at the end, with the same tokens, text and logprobs."""
from __future__ import annotations

import asyncio

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.types import GenerateRequest, SamplingParams


async def _run(engine: AsyncEngine, reqs: list[GenerateRequest]) -> list[list]:
    async def one(req):
        return [out async for out in engine.generate(req)]
    try:
        return await asyncio.gather(*(one(r) for r in reqs))
    finally:
        await engine.shutdown()


def test_non_streamed_requests_get_first_and_merged_final_delta(demo_dense):
    eng = AsyncEngine(LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                             max_model_len=128)))
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = eng.tokenizer.encode("Who are you?")
    reqs = [GenerateRequest(f"r{i}-{stream}", prompt, params, stream=stream)
            for i in range(3) for stream in (True, False)]
    results = asyncio.run(_run(eng, reqs))
    for req, outs in zip(reqs, results):
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 9
        assert len(outs) == (9 if req.stream else 2)
        assert sum(len(o.token_ids) for o in outs) == 9
        assert len(outs[0].token_ids) == 1  # the first token arrives alone, as soon as it exists
    streamed, quiet = results[0], results[1]
    assert [t for o in quiet for t in o.token_ids] == [t for o in streamed for t in o.token_ids]
    assert "".join(o.text for o in quiet) == "".join(o.text for o in streamed)
    assert [lp.token_id for o in quiet for lp in o.logprobs] == [t for o in streamed for t in o.token_ids]


def test_merged_keeps_order_and_the_last_state():
    from loraserve.engine.types import RequestOutput, TokenLogprob
    a = RequestOutput("x", [1], "a", None, [None], None, 3, 1, "rev1")
    b = RequestOutput("x", [2, 3], "bc", [TokenLogprob(2, -0.1, {}), TokenLogprob(3, -0.2, {})],
                      None, "stop", 3, 3, None)
    m = a.merged(b)
    assert (m.token_ids, m.text, m.finish_reason, m.num_output_tokens) == ([1, 2, 3], "abc", "stop", 3)
    assert m.prompt_logprobs == [None] and m.adapter_revision == "rev1" and len(m.logprobs) == 2
