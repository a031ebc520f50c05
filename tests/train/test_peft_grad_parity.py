"""forward_backward on the resident base equals transformers + PEFT on the same tiny checkpoint:
the loss and every LoRA gradient, for each Tinker loss, dense Qwen3, tied Llama (biases) and
Qwen3-MoE (attention and lm_head: experts are not trained), with the base's linears plain or
prepacked (oneDNN layout)."""
from __future__ import annotations

import pytest
import torch

from loraserve.model.loader import load_model
from loraserve.model.prepack import can_prepack, prepack_linears
from loraserve.train.config import RunConfig
from loraserve.train.run import AdamParams, Datum, TrainingRun

RANK, ALPHA = 4, 8.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _data(vocab: int, seed: int) -> list[Datum]:
    """Three datums of different lengths, weights/advantages of both signs, sampler logprobs
    near the model's so some PPO ratios clip and some do not."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (5, 9, 3):
        toks = torch.randint(0, vocab, (n + 1,), generator=g)
        out.append(Datum(toks[:-1].clone(), {
            "target_tokens": toks[1:].clone(),
            "weights": torch.rand(n, generator=g),
            "advantages": torch.randn(n, generator=g),
            "logprobs": None,  # filled per model below
        }))
    return out


def _with_sampler_logprobs(data, target_lps, seed):
    g = torch.Generator().manual_seed(seed)
    return [Datum(d.tokens, {**{k: v for k, v in d.inputs.items() if k != "logprobs"},
                             "logprobs": lp + 0.4 * torch.randn(lp.shape, generator=g)})
            for d, lp in zip(data, target_lps)]


def _reference_elementwise(loss: str, lp, inputs):
    """Tinker's definitions, written out independently of loraserve.train.losses."""
    if loss == "cross_entropy":
        return -lp * inputs["weights"]
    ratio = torch.exp(lp - inputs["logprobs"])
    if loss == "importance_sampling":
        return -(ratio * inputs["advantages"])
    clipped = torch.clamp(ratio, 0.8, 1.2)
    return -torch.min(ratio * inputs["advantages"], clipped * inputs["advantages"])


def _peft(base_dir, factors: dict[str, torch.Tensor], targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                                            lora_dropout=0.0, init_lora_weights=False))
    named = {}
    for name, p in peft.named_parameters():
        if "lora_" in name:
            key = name.removeprefix("base_model.model.").removeprefix("model.").replace(".default.weight", "")
            with torch.no_grad():
                p.copy_(factors[key])
            named[key] = p
    assert set(named) == set(factors)
    return peft, named


def _peft_loss_and_grads(peft, named, data, loss):
    total = 0.0
    grads = {k: torch.zeros_like(p) for k, p in named.items()}
    lps = []
    for d in data:
        logits = peft(input_ids=d.tokens.view(1, -1)).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(1, d.inputs["target_tokens"].view(-1, 1)).view(-1)
        lps.append(lp.detach())
        if loss is None:
            continue
        value = _reference_elementwise(loss, lp, d.inputs).sum()
        for (k, _), g in zip(named.items(), torch.autograd.grad(value, list(named.values()))):
            grads[k] += g
        total += value.item()
    return total, grads, lps


def _run(base_dir, packed: bool, targets: dict) -> TrainingRun:
    model = load_model(base_dir, dtype=torch.float32)
    if packed:
        assert can_prepack(torch.device("cpu"), torch.float32)
        assert prepack_linears(model, batch_hint=8) > 0
    run = TrainingRun(model, RunConfig(rank=RANK, alpha=ALPHA, seed=3, **targets))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B is zero at init, which makes every A gradient zero: draw both
        for t in run.factors.named_tensors().values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return run


def _close(got, want, what):
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err <= 1e-5, f"{what}: relative error {err:.2e}"


CASES = [("hf_dense", False, dict()), ("hf_dense", True, dict(train_mlp=False)),
         ("hf_llama", False, dict(train_attn=False)), ("hf_llama", True, dict()),
         ("hf_moe", False, dict(train_mlp=False))]  # Qwen3-MoE: attention and lm_head (no expert LoRA)


@pytest.mark.parametrize("base,packed,targets", CASES)
def test_forward_backward_matches_peft(base, packed, targets, request, one_torch_thread):
    base_dir = request.getfixturevalue(base)
    run = _run(base_dir, packed, targets)
    factors = {k: v.detach().clone() for k, v in run.factors.named_tensors().items()}
    kinds = sorted({k.split(".")[-2] for k in factors})
    peft, named = _peft(base_dir, factors, kinds)
    data = _data(run.vocab_size, seed=11)
    _, _, ref_lps = _peft_loss_and_grads(peft, named, data, None)
    data = _with_sampler_logprobs(data, ref_lps, seed=5)
    for loss in ("cross_entropy", "importance_sampling", "ppo"):
        needed = {"cross_entropy": ("target_tokens", "weights")}.get(loss, ("target_tokens", "logprobs", "advantages"))
        mine = [Datum(d.tokens, {k: d.inputs[k] for k in needed}) for d in data]
        p = run.start(mine, loss)
        while not p.advance(max_tokens=9):  # slices of at most 9 tokens (test_long_datum splits one)
            pass
        result = p.finish()
        ref_loss, ref_grads, _ = _peft_loss_and_grads(peft, named, data, loss)
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-5), loss
        for out, d, lp in zip(result.outputs, data, ref_lps):
            _close(out["logprobs"], lp, f"{loss} logprobs")
            _close(out["elementwise_loss"], _reference_elementwise(loss, lp, d.inputs), f"{loss} elementwise")
        got = dict(zip(run.factors.named_tensors(), run.grads))
        for name, want in ref_grads.items():
            _close(got[name], want, f"{loss} grad {name}")
        run.grads = None  # the next loss starts from no accumulated gradient
