"""The engine against outside references: transformers' generate, and our own model decoding
one token at a time by full recomputation (no KV cache, no batching)."""
from __future__ import annotations

import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.client.output_processor import OutputProcessor
from loraserve.engine.types import GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), device="cpu", dtype="float32", **kw))


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def _recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor(ids)
        hidden = model(x, torch.arange(len(ids)), None)
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def test_greedy_matches_full_recompute_with_requests_joining_midflight(demo_dense):
    eng = _engine(demo_dense, max_batch_size=4, kv_cache_mb=1, block_size=4)
    prompts = _prompts(eng.vocab_size, [3, 17, 9, 30, 1, 12])
    seqs = [eng.add_request(GenerateRequest(f"r{i}", p, GREEDY)) for i, p in enumerate(prompts[:3])]
    for _ in range(3):
        eng.step()
    seqs += [eng.add_request(GenerateRequest(f"r{i + 3}", p, GREEDY)) for i, p in enumerate(prompts[3:])]
    while eng.has_work():
        eng.step()
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_ids == _recompute_greedy(eng.model, prompt, GREEDY.max_tokens)
    assert eng.blocks.num_free == eng.blocks.num_blocks  # everything returned


def test_preemption_under_a_tiny_kv_cache_keeps_outputs_exact(demo_dense):
    # 24 blocks x 4 tokens = 96 KV slots for 4 sequences that need ~40 each: the scheduler
    # must preempt (recompute) and still produce exactly the unbatched greedy tokens
    eng = _engine(demo_dense, max_batch_size=4, block_size=4, max_model_len=64, num_kv_blocks=24)
    prompts = _prompts(eng.vocab_size, [20, 25, 30, 22], seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert out == _recompute_greedy(eng.model, prompt, 16)
    assert eng.blocks.num_free == 24


def test_greedy_matches_transformers_generate_dense_and_moe(hf_dense, hf_moe):
    from transformers import AutoModelForCausalLM

    for model_dir in (hf_dense, hf_moe):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eng = _engine(model_dir, max_batch_size=8)
        prompts = _prompts(eng.vocab_size, [5, 11, 2, 19], seed=7)
        outs = eng.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              min_new_tokens=GREEDY.max_tokens, pad_token_id=0)
            assert out == ref[0, len(prompt):].tolist(), model_dir.name


def test_prompt_logprobs_match_transformers(hf_moe):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_moe, dtype=torch.float32).eval()
    eng = _engine(hf_moe)
    prompt = _prompts(eng.vocab_size, [13], seed=11)[0]
    seq = eng.add_request(GenerateRequest("echo", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2)))
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert len(outs) == 1 and outs[0].finish_reason == "length" and outs[0].token_ids == []
    lps = outs[0].prompt_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        assert abs(lps[i].logprob - float(ref[i - 1, prompt[i]])) < 1e-4
        assert len(lps[i].top) == 2
    assert seq.is_finished


def test_seeded_sampling_does_not_depend_on_batch_neighbours(demo_dense):
    eng = _engine(demo_dense)
    prompt = _prompts(eng.vocab_size, [6], seed=5)[0]
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = eng.generate([prompt], p)[0]
    others = _prompts(eng.vocab_size, [4, 9, 14], seed=6)
    noise = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    crowd = eng.generate([others[0], prompt, others[1], others[2]], [noise, p, noise, noise])[1]
    assert alone == crowd


def test_stop_strings_and_stop_ids(demo_dense):
    eng = _engine(demo_dense)
    prompt = _prompts(eng.vocab_size, [8], seed=2)[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_id = free[4]
    cut = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert cut == free[: free.index(stop_id) + 1]
    text = eng.tokenizer.decode(free)
    stop = text[3:5]
    # stop strings are the API side's: its OutputProcessor turns the core's token deltas into
    # text and has the core abort the request when one matches
    req = GenerateRequest("s", prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                      ignore_eos=True, stop=[stop]))
    proc = OutputProcessor(eng.tokenizer)
    proc.add(req)
    seq = eng.add_request(req)
    outs = []
    while eng.has_work():
        ready, ended = proc.process(eng.step())
        outs += ready
        for rid in ended:
            eng.abort(rid)
    assert outs[-1].finish_reason == "stop" and seq.finish_reason == "abort"
    assert "".join(o.text for o in outs) == text[: text.index(stop)]


def test_default_kv_cache_holds_a_full_batch_when_lengths_are_not_block_multiples(demo_dense):
    # 37 tokens need 3 blocks of 16; sizing in tokens (37 // 16 = 2 blocks) used to refuse this
    eng = _engine(demo_dense, max_batch_size=1, max_model_len=37)
    assert eng.blocks.num_blocks == 3
    prompt = _prompts(eng.vocab_size, [30])[0]
    assert len(eng.generate([prompt], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]) == 7
