"""Chunked prefill: prompts longer than `max_batched_tokens` are computed a chunk per step, decode
steps run between the chunks, and every output equals full recomputation."""
from __future__ import annotations

import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.types import GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 128)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), device="cpu", dtype="float32", **kw))


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in lengths]


def test_chunked_outputs_equal_unchunked_and_decode_runs_between_chunks(demo_dense):
    whole = _engine(demo_dense)
    prompts = _prompts(whole.vocab_size, [70, 5, 33, 12], seed=11)
    want = whole.generate(prompts, GREEDY)
    eng = _engine(demo_dense, max_batched_tokens=16, block_size=4)
    steps = []
    run = eng.runner.run
    eng.runner.run = lambda seqs, is_prefill: (
        steps.append(("prefill" if is_prefill else "decode", [q.request_id for q in seqs])), run(seqs, is_prefill))[1]
    short = eng.add_request(GenerateRequest("short", prompts[1], GREEDY))
    eng.step()                                            # the short prompt prefills alone
    long = eng.add_request(GenerateRequest("long", prompts[0], GREEDY))
    while not long.output_ids:                            # 70 tokens in chunks of 16
        eng.step()
    assert steps[1::2] == [("prefill", ["long"])] * 5     # ceil(70 / 16) chunks
    assert steps[2::2] == [("decode", ["short"])] * 4     # and a decode step between every two
    rest = [eng.add_request(GenerateRequest(f"r{i}", p, GREEDY)) for i, p in enumerate(prompts[2:])]
    while eng.has_work():
        eng.step()
    assert [long.output_ids, short.output_ids] + [s.output_ids for s in rest] == want
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_prompt_logprobs_are_not_chunked(demo_dense):
    prompt = _prompts(250, [40], seed=12)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    got = []
    for budget in (4096, 8):
        eng = _engine(demo_dense, max_batched_tokens=budget)
        seq = eng.add_request(GenerateRequest("p", prompt, params))
        while eng.has_work():
            eng.step()
        got.append(([lp.logprob for lp in seq.prompt_logprobs[1:]], seq.output_ids))
    assert got[0][1] == got[1][1]
    torch.testing.assert_close(torch.tensor(got[1][0]), torch.tensor(got[0][0]), rtol=0, atol=1e-5)


def test_chunked_prefill_with_preemption_and_prefix_cache(demo_dense):
    whole = _engine(demo_dense, max_model_len=64)
    prompts = _prompts(whole.vocab_size, [30, 41, 25, 36], seed=13)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = whole.generate(prompts, params)
    eng = _engine(demo_dense, max_model_len=64, block_size=4, num_kv_blocks=20, max_batched_tokens=12,
                  max_batch_size=4)
    assert eng.generate(prompts, params) == want
    assert eng.generate(prompts, params) == want          # again, now partly from the prefix cache
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.prefix_hit_tokens > 0
    eng.blocks.check_invariants([])


def test_cpu_default_step_budget_is_the_training_slice(demo_dense):
    """No flag: a CPU engine prefills at most 512 tokens a step (a step is not preempted; 4096
    held every other stream for tens of seconds on 2 cores), and a 600-token prompt takes two
    steps with the short one's decode between them; an explicit budget is kept as given."""
    eng = _engine(demo_dense, max_model_len=700)
    assert eng.cfg.max_batched_tokens is None
    assert eng.scheduler.max_batched_tokens == 512 == eng.cfg.train_max_tokens
    assert _engine(demo_dense, max_batched_tokens=4096).scheduler.max_batched_tokens == 4096
    steps = []
    run = eng.runner.run
    eng.runner.run = lambda seqs, is_prefill: (
        steps.append((is_prefill, sum(q.num_scheduled for q in seqs), [q.request_id for q in seqs])),
        run(seqs, is_prefill))[1]
    short_prompt, long_prompt = _prompts(eng.vocab_size, [5, 600], seed=13)
    eng.add_request(GenerateRequest("short", short_prompt, GREEDY))
    eng.step()
    long = eng.add_request(GenerateRequest("long", long_prompt, GREEDY))
    while not long.output_ids:
        eng.step()
    assert [(p, n) for p, n, ids in steps if ids == ["long"]] == [(True, 512), (True, 88)]
    assert steps[2][0] is False and steps[2][2] == ["short"]  # a decode step between the chunks
