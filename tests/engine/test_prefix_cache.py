"""Automatic prefix caching: block bookkeeping (hits, references, LRU reuse, adapter namespaces)
and, through the engine, outputs identical to recomputing every prompt."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.engine.core.block_manager import BlockManager
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.types import GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _seq(ids: list[int], adapter=None, **params) -> Sequence:
    return Sequence("s", list(ids), SamplingParams(**params) if params else GREEDY, adapter_key=adapter)


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    """What a prefill step does to the books: allocate, compute everything, register."""
    bm.allocate(seq)
    seq.num_cached = len(seq)
    bm.commit([seq])


def test_second_sequence_takes_the_cached_prefix_and_computes_the_rest():
    bm = BlockManager(16, 4)
    first = _seq(range(10))                       # blocks [0-3] [4-7] [8-9]
    _prefill(bm, first)
    assert bm.num_cached_blocks == 2              # only full blocks are registered
    second = _seq(list(range(8)) + [50, 51, 52])  # shares two full blocks
    bm.allocate(second)
    assert second.block_table[:2] == first.block_table[:2] and second.num_cached == 8
    assert second.block_table[2] not in first.block_table
    assert bm.prefix_hit_tokens == 8 and bm.prefix_query_tokens == 21


def test_the_last_token_is_always_computed_in_a_fresh_block():
    bm = BlockManager(16, 4)
    _prefill(bm, _seq(range(8)))
    again = _seq(range(8))                        # the same 8 tokens: only the first block is reused
    bm.allocate(again)
    assert again.num_cached == 4 and len(again.block_table) == 2


def test_adapters_and_prompt_logprobs_do_not_share():
    bm = BlockManager(16, 4)
    _prefill(bm, _seq(range(9), adapter=("t/a", "r1")))
    for other in (_seq(range(9)), _seq(range(9), adapter=("t/a", "r2")), _seq(range(9), adapter=("t/b", "r1")),
                  _seq(range(9), adapter=("t/a", "r1"), max_tokens=4, prompt_logprobs=0)):
        bm.allocate(other)
        assert other.num_cached == 0, other.adapter_key
    same = _seq(range(9), adapter=("t/a", "r1"))
    bm.allocate(same)
    assert same.num_cached == 8


def test_freed_blocks_stay_cached_until_fresh_blocks_run_out_lru_first():
    bm = BlockManager(4, 4)
    a = _seq(range(100, 109))                     # blocks 0 1 2, the two full ones registered
    _prefill(bm, a)
    bm.free(a)
    assert bm.num_free == 4 and bm.usage == 0.0 and bm.num_cached_blocks == 2
    b = _seq(range(200, 212))                     # 3 fresh blocks: 2 never registered, then 1 idle
    _prefill(bm, b)
    bm.free(b)
    c = _seq(range(100, 109))
    bm.allocate(c)
    assert c.num_cached == 4                      # a's tail block was reused first, its head survives


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(8, 4)
    a, b = _seq(range(9)), _seq(range(9))
    _prefill(bm, a)
    bm.allocate(b)
    shared = a.block_table[0]
    bm.free(a)
    assert shared not in bm._free and shared not in bm._idle   # b still holds it
    bm.free(b)
    assert shared in bm._idle and bm.num_free == 8


def test_disabled_prefix_caching_recomputes():
    bm = BlockManager(8, 4, prefix_caching=False)
    _prefill(bm, _seq(range(9)))
    again = _seq(range(9))
    bm.allocate(again)
    assert again.num_cached == 0 and bm.num_cached_blocks == 0


def test_engine_outputs_equal_recompute_with_shared_prefixes_and_preemption(demo_dense):
    eng = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=60,
                                 max_batch_size=4, block_size=4, num_kv_blocks=15))
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, eng.vocab_size - 3, (21,), generator=g).tolist()
    prompts = [system + torch.randint(3, eng.vocab_size - 3, (n,), generator=g).tolist() for n in (3, 9, 1, 14)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.blocks.prefix_caching = False
    want = eng.generate(prompts, params)
    eng.blocks.prefix_caching = True
    first = eng.generate(prompts[:1], params)       # registers the shared system prompt
    before = eng.scheduler.num_preemptions
    again = eng.generate(prompts, params)           # 4 x ~40 tokens in 15 blocks: preempts
    assert first == want[:1] and again == want
    assert eng.scheduler.num_preemptions > before
    assert eng.blocks.prefix_hit_tokens >= 3 * 20
    assert eng.stats()["prefix_cache_hit_rate"] > 0
    assert eng.blocks.num_free == 15
    eng.blocks.check_invariants([])


def test_engine_greedy_with_a_fully_cached_prompt_matches(demo_dense):
    eng = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=96,
                                 block_size=4))
    prompt = torch.randint(3, eng.vocab_size - 3, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = [eng.generate([prompt], GREEDY)[0] for _ in range(3)]
    assert outs[0] == outs[1] == outs[2]
    assert eng.blocks.prefix_hit_tokens == 2 * 12    # blocks 0-2 of 4: the last block is recomputed
    seq = eng.add_request(GenerateRequest("lp", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    while eng.has_work():
        eng.step()
    assert len(seq.prompt_logprobs) == len(prompt)   # prompt logprobs bypass the cache


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt"]), st.integers(0, 5),
                          st.integers(1, 30), st.sampled_from([None, ("t/a", "r1")])), max_size=60))
def test_random_workload_keeps_the_books_balanced(ops):
    """Sequences drawn from a few shared prefixes come and go, grow and get preempted; after every
    operation each block is exactly one of free, idle-cached or referenced, and cached prefixes
    are found only where they were registered."""
    bm = BlockManager(24, 4)
    live: list[Sequence] = []
    for op, which, length, adapter in ops:
        if op == "add":
            seq = _seq([which] * 6 + list(range(100, 100 + length)), adapter=adapter)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                assert seq.num_cached % 4 == 0 and seq.num_cached < len(seq)
                seq.num_cached = len(seq)
                bm.commit([seq])
                live.append(seq)
        elif live:
            seq = live[which % len(live)]
            if op == "grow":
                seq.output_ids.append(7)  # as in decode: the new token is in seq, its K/V not yet
                if bm.can_append(seq):
                    bm.allocate(seq)
                    seq.num_cached = len(seq)
                    bm.commit([seq])
                else:
                    seq.output_ids.pop()
            elif op in ("free", "preempt"):
                bm.free(seq)
                live.remove(seq)
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks


def test_one_sequence_at_a_time_gets_consecutive_blocks_whatever_was_freed_before():
    """Fresh blocks come lowest first, so a lone sequence's context is one run of the cache
    (`PagedAttention.kv_run` reads it as a slice): however earlier sequences freed theirs."""
    bm = BlockManager(12, 4, prefix_caching=False)
    a, b = _seq(range(10)), _seq(range(20, 33))
    bm.allocate(a), bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5, 6]
    bm.free(a), bm.free(b)           # freed tail first, in two interleaved runs
    for n in (30, 7, 45):
        seq = _seq(range(n))
        bm.allocate(seq)
        assert seq.block_table == list(range(len(seq.block_table)))
        bm.free(seq)
    bm.check_invariants([])
