"""The compiled decode step (engine.core.decode_graphs) gives what the eager step gives: the same greedy
tokens and logprobs within 1e-5, for base-only batches and batches mixing adapters (LoRA on every
target kind, lm_head included), and PEFT's greedy continuations.

On this CPU the graphs are torch.compile (inductor) graphs with dynamic batch and context axes;
on CUDA the same buckets are CUDA graphs.
Buckets are kept few: each graph takes seconds to compile here.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from loraserve.engine.core.build import build_engine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.decode_graphs import CPU_LORA_MAX_BATCH, DecodeGraphs, batch_buckets, context_buckets
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.model.prepack import PackedLinear

from .test_peft_parity import TOKENS, _peft_reference, _prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED = ["t/qv-r4", None, "t/all-r8-rslora", "t/o-head-r2"]


def _engine(aset, compile: str, catalog, **kw):
    return build_engine(EngineConfig(
        model_dir=str(aset.base), catalog_dir=str(catalog), device=DEVICE, dtype="float32",
        max_model_len=96, max_batch_size=6, max_gpu_adapters=8, max_lora_rank=16,
        compile=compile, compile_batch_sizes=[2, 4], **kw))


@pytest.fixture(scope="module")
def engines(dense_set, tmp_path_factory):
    """(eager, compiled) engines over the same base and a copy each of one catalog (LMDB opens
    an environment once per process). The compiled one runs LoRA steps through graphs too,
    which the CPU leaves eager by default (see engine.core.decode_graphs). Its base weights are
    packed for oneDNN, and stay packed: the graphs call the packed GEMM (model.prepack)."""
    copy = tmp_path_factory.mktemp("compiled") / "catalog"
    shutil.copytree(dense_set.catalog, copy)
    compiled = _engine(dense_set, "off", copy, weight_prepack="on")
    graphs = DecodeGraphs(compiled.model, compiled.cache, compiled.device, compiled.runner.lora,
                          compiled.scratch_block, (2, 4), context_buckets(compiled.max_model_len, 16),
                          lora_graphs=True)
    graphs.warm_up()
    compiled.runner.graphs = graphs
    assert any(isinstance(m, PackedLinear) for m in compiled.model.modules())
    return _engine(dense_set, "off", dense_set.catalog), compiled


def _greedy(eng, adapters, prompts, tokens=TOKENS + 4):
    seqs = [eng.add_request(GenerateRequest(f"c{i}-{id(prompts)}", p, SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2), a))
        for i, (a, p) in enumerate(zip(adapters, prompts))]
    while eng.has_work():
        eng.step()
    return [(s.output_ids, s.output_logprobs) for s in seqs]


def _assert_same(eager, compiled):
    for (ids_e, lps_e), (ids_c, lps_c) in zip(eager, compiled):
        assert ids_c == ids_e
        for a, b in zip(lps_e, lps_c):
            assert a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) <= 1e-5, (a, b)
            assert list(a.top) == list(b.top)
            assert all(abs(a.top[t] - b.top[t]) <= 1e-5 for t in a.top)


@pytest.mark.parametrize("adapters", [[None] * 3, MIXED], ids=["base", "mixed"])
def test_compiled_decode_equals_eager(engines, adapters):
    eager, compiled = engines
    graphs = compiled.runner.graphs
    assert graphs is not None and eager.runner.graphs is None
    prompts = _prompts(eager.vocab_size, len(adapters), seed=7)
    before = graphs.steps
    want = _greedy(eager, adapters, prompts)
    got = _greedy(compiled, adapters, prompts)
    assert graphs.steps - before >= TOKENS  # the decode steps did run through the graphs
    _assert_same(want, got)


def test_compiled_decode_matches_peft(engines, dense_set):
    _, compiled = engines
    prompts = _prompts(compiled.vocab_size, len(MIXED), seed=1)
    results = _greedy(compiled, MIXED, prompts, tokens=TOKENS)
    for adapter, prompt, (ids, _) in zip(MIXED, prompts, results):
        assert ids == _peft_reference(dense_set, adapter, prompt)[1], adapter


def test_batches_past_the_largest_bucket_run_eagerly(engines):
    """Five sequences (the largest bucket is 4, the batch 6) decode eagerly, and equal the eager engine;
    contexts past the last context bucket have no bucket either."""
    eager, compiled = engines
    graphs = compiled.runner.graphs
    assert graphs.bucket(5, 10) is None and graphs.bucket(4, graphs.context_sizes[-1] + 1) is None
    assert graphs.bucket(3, 65) == (4, graphs.context_sizes[1])
    adapters = MIXED + ["t/qv-r4"]
    prompts = _prompts(eager.vocab_size, len(adapters), seed=9)
    before = graphs.steps
    got = _greedy(compiled, adapters, prompts)
    assert graphs.steps == before
    _assert_same(_greedy(eager, adapters, prompts), got)


def test_a_step_whose_contexts_fill_their_bucket_runs_the_warm_graph(engines, monkeypatch):
    """Two sequences whose contexts reach a context bucket (64) exactly make a step with no padded
    position (`PagedAttention.full`, and for one sequence `kv_run`): it runs the graph warm-up
    made. The compiled step reads no such per-step field; when it did, that step recompiled while
    serving (~45 s at 0.6B shapes, past the engine timeout, which killed the core)."""
    eager, compiled = engines
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, eager.vocab_size - 3, (60,), generator=g).tolist() for _ in range(2)]
    assert compiled.runner.graphs.bucket(2, 64) == (2, 64)
    from torch._dynamo.utils import counters
    monkeypatch.setattr(compiled.runner.graphs, "stance", "default")  # a recompile would compile
    before, compiles = compiled.runner.graphs.steps, counters["frames"]["ok"]
    got = _greedy(compiled, [None, None], prompts, tokens=8)
    assert compiled.runner.graphs.steps - before >= 7
    assert counters["frames"]["ok"] == compiles, "the step recompiled"
    _assert_same(_greedy(eager, [None, None], prompts, tokens=8), got)


def test_a_step_no_warm_graph_fits_runs_eagerly_instead_of_compiling(engines, monkeypatch):
    """After warm-up, a step that fails every graph's guards (here: a layer's sliding window
    changed to one longer than any context, which changes no result) runs eagerly: nothing
    compiles while serving, and the tokens are the eager engine's."""
    eager, compiled = engines
    from torch._dynamo.utils import counters
    assert compiled.runner.graphs.stance == "eager_on_recompile"
    monkeypatch.setattr(compiled.model.model.layers[0].self_attn, "window", 10_000)
    prompts = _prompts(eager.vocab_size, 2, seed=11)
    compiles = counters["frames"]["ok"]
    got = _greedy(compiled, [None, None], prompts, tokens=6)
    assert counters["frames"]["ok"] == compiles
    _assert_same(_greedy(eager, [None, None], prompts, tokens=6), got)


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(1) == (1,)
    assert context_buckets(2048, 16) == (64, 128, 256, 512, 1024, 2048)
    assert context_buckets(100, 16) == (64, 112)
    assert context_buckets(40, 16) == (48,)


def test_choose_keeps_the_faster_step_per_batch_bucket(engines):
    """`choose` times each batch bucket compiled against eager; a bucket is served by its graph
    exactly when the graph measured faster, and the steps stay equal to eager's either way."""
    eager, compiled = engines
    graphs = DecodeGraphs(compiled.model, compiled.cache, compiled.device, compiled.runner.lora,
                          compiled.scratch_block, (2, 4), context_buckets(compiled.max_model_len, 16))
    graphs.warm_up()
    if graphs.kind != "inductor":
        assert graphs.choose() == set()   # CUDA graphs are not second-guessed
        return
    slower = graphs.choose(reps=2)
    assert set(graphs.timings) == {2, 4}
    for b, (eager_s, compiled_s) in graphs.timings.items():
        assert (b in slower) == (compiled_s >= eager_s)
        assert (graphs.bucket(b, 10) is None) == (b in slower)
    saved, compiled.runner.graphs = compiled.runner.graphs, graphs
    try:
        prompts = _prompts(eager.vocab_size, 3, seed=11)
        _assert_same(_greedy(eager, [None] * 3, prompts), _greedy(compiled, [None] * 3, prompts))
    finally:
        compiled.runner.graphs = saved


def test_what_compiles_by_default(engines, moe_set):
    """auto: CUDA graphs on CUDA (LoRA steps included), on the CPU only for a base that outgrows
    the last-level cache (not this one), its LoRA steps in the small batch buckets; on: the CPU
    compiles too; MoE bases never compile; off is off."""
    from loraserve.engine.core.build import compiles

    eager, _ = engines
    eng = build_engine(EngineConfig(model_dir=str(moe_set.base), device="cpu", compile="on",
                                    max_model_len=64, max_batch_size=2))
    assert eng.runner.graphs is None and not compiles(eng.cfg, eng)
    assert compiles(EngineConfig(model_dir="x", compile="on"), eager)
    assert not compiles(EngineConfig(model_dir="x", compile="off"), eager)
    assert compiles(EngineConfig(model_dir="x"), eager) == (eager.device.type == "cuda")
    default = DecodeGraphs(eager.model, eager.cache, eager.device, eager.runner.lora,
                           eager.scratch_block, (4, 8), (64,))
    # LoRA steps through graphs: every bucket on CUDA, the small ones on the CPU
    cpu = eager.device.type == "cpu"
    assert default.lora_batches == ({4} if cpu else {4, 8}) and CPU_LORA_MAX_BATCH == 4
    assert default.bucket(3, 10) is None  # no graph made yet: nothing runs through one
    default.ready = {(b, lora) for b in (4, 8) for lora in default.variants(b)}  # as if made
    assert default.bucket(3, 10, has_lora=True) == (4, 64)
    assert default.bucket(7, 10, has_lora=True) == (None if cpu else (8, 64))
    assert default.bucket(7, 10) == (8, 64)
    off = DecodeGraphs(eager.model, eager.cache, eager.device, eager.runner.lora,
                       eager.scratch_block, (4,), (64,), lora_graphs=False)
    off.ready = {(4, False)}
    assert off.lora_batches == set() and off.bucket(3, 10, has_lora=True) is None
    with pytest.raises(ValueError, match="compile must be"):
        EngineConfig(model_dir="x", compile="sometimes")
