"""A served adapter equals transformers + PEFT on the same adapter: prompt logprobs (prefill path,
every position, lm_head LoRA included) and greedy continuations (decode path), alone and mixed in
one batch with other adapters and base-only requests, on both LoRA backends."""
from __future__ import annotations

import pytest
import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.engine.core.build import build_engine
from loraserve.model.prepack import PackedLinear

TOKENS = 6


def _engine(aset, backend: str, **kw):
    return build_engine(EngineConfig(model_dir=str(aset.base), catalog_dir=str(aset.catalog), device="cpu",
                                     dtype="float32", max_model_len=128, lora_backend=backend,
                                     max_gpu_adapters=kw.pop("max_gpu_adapters", 8), max_lora_rank=16, **kw))


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _peft_reference(aset, adapter: str | None, prompt: list[int]):
    """(log_softmax over the prompt [P, V], greedy continuation) from transformers (+ PEFT)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(aset.base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, aset.peft_dirs[adapter]).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for _ in range(TOKENS):  # greedy by full recompute (generate's min_new_tokens would mask EOS)
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return logp, ids[0, len(prompt):].tolist()


def _run_mixed(eng, requests):
    """requests: [(adapter | None, prompt)] all in one batch -> [(prompt_logprobs, output ids)]."""
    seqs = [eng.add_request(GenerateRequest(f"m{i}", prompt, SamplingParams(
        max_tokens=TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0), adapter))
        for i, (adapter, prompt) in enumerate(requests)]
    while eng.has_work():
        eng.step()
    return [(s.prompt_logprobs, s.output_ids) for s in seqs]


def _check(aset, eng, adapters, seed):
    prompts = _prompts(eng.vocab_size, len(adapters), seed)
    results = _run_mixed(eng, list(zip(adapters, prompts)))
    for adapter, prompt, (lps, out) in zip(adapters, prompts, results):
        ref_logp, ref_out = _peft_reference(aset, adapter, prompt)
        got = torch.tensor([lp.logprob for lp in lps[1:]])
        want = ref_logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (adapter, (got - want).abs().max())
        assert out == ref_out, adapter


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dense_adapters_mixed_batch_match_peft(dense_set, backend):
    eng = _engine(dense_set, backend)
    adapters = ["t/qv-r4", None, "t/all-r8-rslora", "t/o-head-r2", "t/qv-r4"]
    _check(dense_set, eng, adapters, seed=1)


@pytest.mark.parametrize("base", ["dense_set", "moe_set"])
def test_packed_base_weights_mixed_batch_match_peft(base, request):
    """The base's linear weights in oneDNN's layout (loraserve.model.prepack), under the LoRA
    wrappers: a mixed batch still equals transformers + PEFT."""
    aset = request.getfixturevalue(base)
    eng = _engine(aset, "torch", weight_prepack="on")
    attn = eng.model.model.layers[0].self_attn  # q/k/v fused into one packed GEMM, LoRA per slice
    assert isinstance(attn.qkv_proj, PackedLinear) and isinstance(attn.o_proj.base, PackedLinear)
    adapters = ["t/qv-r4", None, "t/all-r8-rslora", "t/o-head-r2"] if base == "dense_set" else \
        ["t/moe-r4", None, "t/moe-r4"]
    _check(aset, eng, adapters, seed=6)


@pytest.mark.parametrize("adapter", ["t/qv-r4", "t/all-r8-rslora", "t/o-head-r2"])
def test_each_dense_adapter_alone_matches_peft(dense_set, adapter):
    """Alone, every decode step after the first takes each target's one-op path (`LoRALinear._one`,
    the plan's own `lora_addmm_` without the plan lookup): its answers are PEFT's too."""
    from loraserve.lora.layers import LoRALinear
    eng = _engine(dense_set, "torch")
    _check(dense_set, eng, [adapter], seed=2)
    assert any(isinstance(m, LoRALinear) and m._one is not None for m in eng.runner.model.modules())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_attention_and_expert_lora_match_peft(moe_set, backend):
    eng = _engine(moe_set, backend)
    _check(moe_set, eng, ["t/moe-r4", None, "t/moe-r4"], seed=3)


def test_evicted_adapter_paged_in_again_gives_identical_output(dense_set):
    eng = _engine(dense_set, "torch", max_gpu_adapters=1)
    prompt = _prompts(eng.vocab_size, 1, seed=4)[0]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    first = eng.generate([prompt], params, ["t/all-r8-rslora"])[0]
    eng.generate([prompt], params, ["t/qv-r4"])  # one slot: evicts the first adapter
    assert ("t/all-r8-rslora", "r1") not in eng.adapters.pool
    again = eng.generate([prompt], params, ["t/all-r8-rslora"])[0]
    assert again == first
    assert eng.adapters.pool.stats.evictions >= 1


def test_a_slot_reused_by_another_adapter_serves_the_new_one(dense_set):
    """Steps with the same batch layout reuse the step before's LoRA metadata and plans; a load
    or eviction in between (a new pool version) must rebuild them."""
    eng = _engine(dense_set, "torch", max_gpu_adapters=1)
    prompt = _prompts(eng.vocab_size, 1, seed=5)[0]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    state = eng.runner.lora
    outs = {}
    for adapter in ["t/all-r8-rslora", "t/qv-r4", "t/o-head-r2", "t/all-r8-rslora"]:
        version = eng.adapters.pool.version
        outs.setdefault(adapter, []).append(eng.generate([prompt], params, [adapter])[0])
        assert eng.adapters.pool.version > version  # each one evicted the last and loaded
    for adapter, got in outs.items():
        want = _peft_reference(dense_set, adapter, prompt)[1]
        assert all(g == want for g in got), adapter
    state.set_slots([0])
    meta = state.meta
    state.set_slots([0])
    assert state.meta is meta  # unchanged layout and pool: reused
    eng.adapters.pool.version += 1
    state.set_slots([0])
    assert state.meta is not meta


def test_prefix_cache_is_per_adapter_revision(dense_set):
    """One long prompt served by two adapters and the base in turn: each matches PEFT, and only
    a repeat on the same adapter reuses cached K/V."""
    eng = _engine(dense_set, "torch")
    prompt = torch.randint(3, eng.vocab_size - 3, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    hits = []
    for adapter in ["t/all-r8-rslora", "t/qv-r4", None, "t/all-r8-rslora"]:
        before = eng.blocks.prefix_hit_tokens
        out = eng.generate([prompt], params, [adapter])[0]
        assert out == _peft_reference(dense_set, adapter, prompt)[1], adapter
        hits.append(eng.blocks.prefix_hit_tokens - before)
    assert hits[:3] == [0, 0, 0] and hits[3] == 32  # two full blocks of 16 before the last token


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_mixed_adapters_match_peft(dense_set, backend):
    """Prompts longer than the 7-token step budget are prefilled in chunks, next to decode steps
    of other adapters' requests; the greedy tokens still match PEFT."""
    eng = _engine(dense_set, backend, max_batched_tokens=7)
    adapters = ["t/all-r8-rslora", None, "t/qv-r4", "t/o-head-r2"]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, eng.vocab_size - 3, (n,), generator=g).tolist() for n in (19, 4, 26, 11)]
    steps = []
    run = eng.runner.run
    eng.runner.run = lambda seqs, pre: (steps.append(pre and any(q.num_scheduled < q.num_pending for q in seqs)),
                                        run(seqs, pre))[1]
    outs = eng.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True), adapters)
    assert sum(steps) >= 5  # several prefill steps left a prompt half done
    for adapter, prompt, out in zip(adapters, prompts, outs):
        assert out == _peft_reference(dense_set, adapter, prompt)[1], adapter


@pytest.mark.parametrize("loop", ["c++", "python"])
def test_base_batches_take_the_decode_plan_and_adapter_batches_do_not(dense_set, monkeypatch, loop):
    """The LoRA wrappers are bypassed only while idle or while each adds one known delta
    (`model.decode_plan`): a base-only batch's decode steps run the plan, a mixed batch's the
    modules, a lone adapter's the plan with its deltas, and all equal PEFT, whether the plan's
    loop runs in C++ (`cpu_fused.decode_layers`, the default) or in Python."""
    from loraserve.engine.core import llm_engine
    from loraserve.model import decode_plan
    monkeypatch.setattr(decode_plan, "NATIVE_LOOP", loop == "c++")
    planned: list[int] = []
    real = decode_plan.DecodePlan.run  # "idle": wrappers skipped; "deltas": each one's known delta added
    monkeypatch.setattr(decode_plan.DecodePlan, "run", lambda self, x, a, deltas=False:
                        planned.append("deltas" if deltas else "idle") or real(self, x, a, deltas))
    eng = _engine(dense_set, "torch")
    assert planned == ["idle"] * llm_engine.WARM_UP_DECODE_STEPS  # its warm-up (LLMEngine.warm_up)
    planned.clear()
    _check(dense_set, eng, [None, None], seed=4)
    assert planned == ["idle"] * (TOKENS - 1)
    # the adapter resident first: a cold one parks its request for the page-in while the base
    # request decodes alone, a step the plan rightly takes (a race under a loaded machine)
    _check(dense_set, eng, ["t/all-r8-rslora"], seed=5)
    planned.clear()
    _check(dense_set, eng, ["t/all-r8-rslora", None], seed=4)
    assert not planned
    # one adapter alone on every target: from the second decode step on, each wrapper's delta is
    # one lora_addmm_ of known rank rows (`one_rows`), added by the plan where the wrapper would
    _check(dense_set, eng, ["t/all-r8-rslora"], seed=5)
    assert planned == ["deltas"] * (TOKENS - 2)
