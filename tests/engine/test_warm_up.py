"""`LLMEngine.warm_up`: the engine runs one short request before it serves (build_engine), so a
user's first request does not page the weights in (bench/RESULTS.md, session 18: SmolLM2's first
request spent 1.6 s in its prefill and 290 + 90 ms in its first two decode steps). The warm-up
must leave nothing a user could see: no sequence, no KV block, no prefix-cache entry or count,
no random number drawn, no step figures."""
from __future__ import annotations

import dataclasses

import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.core import llm_engine
from loraserve.engine.core.build import build_engine
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.types import SamplingParams


def _cfg(base) -> EngineConfig:
    return EngineConfig(model_dir=str(base), device="cpu", dtype="float32", max_model_len=64,
                        torch_threads=1, compile="off", seed=7)


def test_a_built_engine_was_warmed_up_and_shows_nothing_of_it(demo_dense):
    engine = build_engine(_cfg(demo_dense))
    assert not engine.seqs and not engine.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.blocks.num_cached_blocks == 0
    assert engine.blocks.prefix_query_tokens == engine.blocks.prefix_hit_tokens == 0
    assert engine.scheduler.num_preemptions == 0
    assert engine.last_batch_size == 0 and engine.decode_step_s == 0.0
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_usage"] == 0.0
    fresh = torch.Generator().manual_seed(7)
    assert torch.equal(engine.default_gen.get_state(), fresh.get_state())


def test_the_warm_up_runs_a_prefill_and_the_decode_steps(demo_dense):
    engine = LLMEngine(dataclasses.replace(_cfg(demo_dense), block_size=8))  # not warmed up: this test calls it
    kinds = []
    run = engine.runner.run

    def recording(seqs, is_prefill):
        kinds.append(("prefill" if is_prefill else "decode", len(seqs)))
        return run(seqs, is_prefill)

    engine.runner.run = recording
    assert engine.warm_up() > 0
    assert kinds == [("prefill", 1)] + [("decode", 1)] * llm_engine.WARM_UP_DECODE_STEPS
    assert not engine.seqs and engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.blocks.num_cached_blocks == 0  # a small block is still never filled


def test_a_warmed_up_engine_answers_as_one_that_was_not(demo_dense):
    """Greedy and unseeded sampled tokens alike: the warm-up drew from no generator."""
    prompts = [[5, 9, 2, 7], [3, 3, 8]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    warmed, cold = build_engine(_cfg(demo_dense)), LLMEngine(_cfg(demo_dense))
    for params in (greedy, sampled):
        assert warmed.generate(prompts, params) == cold.generate(prompts, params)
