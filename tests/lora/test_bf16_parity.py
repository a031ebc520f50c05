"""`--dtype bfloat16` on the CPU: served adapters against transformers + PEFT in bfloat16, for
each weight layout a bfloat16 server runs: oneDNN-packed (batching servers; bfloat16 GEMMs where
the CPU has AVX512-BF16 or AMX) and plain with one-row steps as `torch.mv` (a big base under
`--max-batch-size 1`). Tolerances are bfloat16's: its 8-bit mantissa rounds each GEMM's output
differently from PEFT's (other summation order, LoRA added to another rounding of the base's
output), so logprobs agree to ~0.1 and a greedy token may take the other side of a near-tie."""
from __future__ import annotations

import torch

import loraserve.engine.core.llm_engine as llm_engine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.model.prepack import PackedLinear, VectorLinear, can_prepack

from .test_peft_parity import _run_mixed

# bfloat16's own error, measured: ours against float32 PEFT may be off by at most this many times
# what PEFT in bfloat16 is off from float32 PEFT (the logits here reach ~30, where bfloat16 rounds
# to 1/8, so a fixed logprob tolerance would be either loose or flaky), plus a little
ERROR_RATIO, ERROR_SLACK = 2.0, 0.05
NEAR_TIE = 0.25      # a greedy token may differ from PEFT's only where PEFT's logits tie this close


def _engine(aset, layout: str, max_batch: int):
    return build_engine(EngineConfig(model_dir=str(aset.base), catalog_dir=str(aset.catalog), device="cpu",
                                     dtype="bfloat16", max_model_len=128, lora_backend="torch",
                                     weight_prepack=layout, max_batch_size=max_batch,
                                     max_gpu_adapters=8, max_lora_rank=16))


def _peft(aset, adapter: str | None, dtype: torch.dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(aset.base, dtype=dtype).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, aset.peft_dirs[adapter]).eval()
    return model


def _logprobs(aset, adapter: str | None, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_peft(aset, adapter, dtype)(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def _check_against_peft(aset, adapter, prompt, prompt_logprobs, output_ids):
    """Prompt logprobs: ours off from float32 PEFT by at most ERROR_RATIO x bfloat16 PEFT's own
    error (+ ERROR_SLACK). Greedy tokens: each one, scored by bfloat16 PEFT on our own prefix, is
    its argmax or within NEAR_TIE of it (teacher forcing: one flipped near-tie does not fail
    every token after it), and mostly its exact argmax."""
    ids = prompt + output_ids
    ref32, ref16 = _logprobs(aset, adapter, torch.float32, ids), _logprobs(aset, adapter, torch.bfloat16, ids)
    n, pos, tok = len(prompt), torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    got = torch.tensor([lp.logprob for lp in prompt_logprobs[1:]])
    ours_err = (got - ref32[pos, tok]).abs().max().item()
    peft_err = (ref16[pos, tok] - ref32[pos, tok]).abs().max().item()
    assert ours_err <= ERROR_RATIO * peft_err + ERROR_SLACK, (adapter, ours_err, peft_err)
    steps = ref16[n - 1: n - 1 + len(output_ids)]
    ours = steps[torch.arange(len(output_ids)), torch.tensor(output_ids)]
    gap = steps.max(-1).values - ours
    assert (gap <= NEAR_TIE).all(), (adapter, output_ids, gap)
    assert (gap == 0).float().mean() >= 0.8, (adapter, gap)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (6 + 3 * i,), generator=g).tolist() for i in range(n)]


def test_packed_bf16_mixed_batch_matches_peft_in_bf16(dense_set):
    """Packed where oneDNN has bfloat16 GEMMs (this CPU), plain `F.linear` in bfloat16 elsewhere."""
    eng = _engine(dense_set, "on", max_batch=4)
    qkv = eng.model.model.layers[0].self_attn.qkv_proj
    if can_prepack(torch.device("cpu"), torch.bfloat16):
        assert isinstance(qkv, PackedLinear) and qkv.packed.dtype == torch.bfloat16
    adapters = ["t/all-r8-rslora", None, "t/qv-r4", "t/o-head-r2"]
    prompts = _prompts(eng.vocab_size, len(adapters), seed=11)
    for adapter, prompt, (lps, out) in zip(adapters, prompts, _run_mixed(eng, list(zip(adapters, prompts)))):
        _check_against_peft(dense_set, adapter, prompt, lps, out)


def test_one_sequence_bf16_torch_mv_matches_peft_in_bf16(dense_set, monkeypatch):
    """The `--max-batch-size 1` layout of a big base (plain weights, one-row GEMMs as `torch.mv`),
    here on the tiny base by telling the engine it outgrows the cache."""
    monkeypatch.setattr(llm_engine, "outgrows_last_level_cache", lambda model: True)
    eng = _engine(dense_set, "auto", max_batch=1)
    assert isinstance(eng.model.model.layers[0].mlp.down_proj.base, VectorLinear)
    assert eng.model.model.layers[0].mlp.down_proj.base.weight.dtype == torch.bfloat16
    for i, adapter in enumerate(["t/all-r8-rslora", None, "t/o-head-r2"]):
        prompt = _prompts(eng.vocab_size, 1, seed=20 + i)[0]
        (lps, out), = _run_mixed(eng, [(adapter, prompt)])
        _check_against_peft(dense_set, adapter, prompt, lps, out)
