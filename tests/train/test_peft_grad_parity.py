"""forward_backward on the resident base equals transformers + PEFT on the same tiny checkpoint:
the loss and every LoRA gradient, for each Tinker loss, dense Qwen3, tied Llama (biases) and
Qwen3-MoE (attention and lm_head; and its experts against PEFT's `target_parameters` LoRA on
transformers 5's fused expert Parameters), with the base's linears plain or prepacked (oneDNN
layout)."""
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


def _close(got, want, what, rel=1e-5):
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.2e}"


CASES = [("hf_dense", False, dict()), ("hf_dense", True, dict(train_mlp=False)),
         ("hf_llama", False, dict(train_attn=False)), ("hf_llama", True, dict()),
         ("hf_moe", False, dict(train_mlp=False))]  # Qwen3-MoE: attention and lm_head (no expert LoRA)


@pytest.mark.parametrize("base,packed,targets", CASES)
def test_forward_backward_matches_peft(base, packed, targets, request, one_torch_thread):
    base_dir = request.getfixturevalue(base)
    run = _run(base_dir, packed, targets)
    # float32 sums in another order on each side: oneDNN's packed GEMMs against PEFT's (~1e-5),
    # and transformers 5.25's forward against ours (up to 1.7e-5 unpacked on hf_dense)
    rel = 3e-5
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
            _close(out["logprobs"], lp, f"{loss} logprobs", rel)
            _close(out["elementwise_loss"], _reference_elementwise(loss, lp, d.inputs), f"{loss} elementwise", rel)
        got = dict(zip(run.factors.named_tensors(), run.grads))
        for name, want in ref_grads.items():
            _close(got[name], want, f"{loss} grad {name}", rel)
        run.grads = None  # the next loss starts from no accumulated gradient


def _peft_experts(base_dir, factors: dict[str, torch.Tensor]):
    """PEFT on Qwen3-MoE as transformers 5 lays its experts out: one [E, 2I, H] gate_up_proj and
    one [E, H, I] down_proj Parameter per layer, LoRA through `target_parameters` (a gate_up
    pair shares its A). Our run trains gate and up apart; with gate's A equal to up's (set
    below) the two models are the same function, and PEFT's gradients are ours summed (A) or
    stacked (B). Returns the model and {our gate/down module path: (PEFT A, PEFT B)}."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    peft = get_peft_model(model, LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], lora_dropout=0.0,
        init_lora_weights=False))
    experts = {}
    for name, m in peft.named_modules():
        if isinstance(m, ParamWrapper):
            layer = name.split("layers.")[1].split(".")[0]
            proj = "gate_proj" if m.parameter_name == "gate_up_proj" else "down_proj"
            experts[f"layers.{layer}.mlp.experts.{proj}"] = (m.lora_A["default"].weight, m.lora_B["default"].weight)
    with torch.no_grad():
        for path, (pa, pb) in experts.items():
            a, b = factors[f"{path}.lora_A"], factors[f"{path}.lora_B"]            # [E, r, in], [E, out, r]
            if path.endswith("gate_proj"):
                b = torch.cat([b, factors[f"{path.replace('gate', 'up')}.lora_B"]], dim=1)  # [E, 2I, r]
            pa.copy_(a.reshape(-1, a.shape[-1]))                                    # [E*r, in]
            pb.copy_(b.permute(1, 2, 0).reshape(b.shape[1], -1))                    # [out, r*E], expert minor
    dense = {k: v for k, v in factors.items() if ".experts." not in k}
    named = {}
    for name, p in peft.named_parameters():
        key = name.removeprefix("base_model.model.").removeprefix("model.").replace(".default.weight", "")
        if key in dense:
            with torch.no_grad():
                p.copy_(dense[key])
            named[key] = p
    named.update({f"{path}#{ab}": t for path, pair in experts.items() for ab, t in zip("AB", pair)})
    return peft, named


def _ours_as_peft(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our expert gradients in PEFT's parameters' layout: gate's and up's A summed (PEFT's one A
    feeds both), gate's and up's B stacked; attention's as they are."""
    out = {k: v for k, v in grads.items() if ".experts." not in k}
    for name in [k for k in grads if k.endswith("experts.gate_proj.lora_A") or k.endswith("experts.down_proj.lora_A")]:
        path = name.removesuffix(".lora_A")
        a, b = grads[name], grads[f"{path}.lora_B"]
        if path.endswith("gate_proj"):
            up = path.replace("gate_proj", "up_proj")
            a, b = a + grads[f"{up}.lora_A"], torch.cat([b, grads[f"{up}.lora_B"]], dim=1)
        out[f"{path}#A"], out[f"{path}#B"] = a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return out


def test_moe_expert_lora_matches_peft_target_parameters(hf_moe, one_torch_thread):
    run = _run(hf_moe, False, dict(train_unembed=False))
    with torch.no_grad():  # PEFT's gate_up LoRA has one A for both: tie ours the same way
        for path, (a, _) in run.factors.pairs.items():
            if path.endswith("experts.up_proj"):
                a.copy_(run.factors.pairs[path.replace("up_proj", "gate_proj")][0])
    factors = {k: v.detach().clone() for k, v in run.factors.named_tensors().items()}
    assert any(".experts." in k for k in factors)
    peft, named = _peft_experts(hf_moe, factors)
    data = _data(run.vocab_size, seed=11)
    _, _, ref_lps = _peft_loss_and_grads(peft, named, data, None)
    data = _with_sampler_logprobs(data, ref_lps, seed=5)
    for loss in ("cross_entropy", "ppo"):
        needed = ("target_tokens", "weights") if loss == "cross_entropy" else ("target_tokens", "logprobs", "advantages")
        p = run.start([Datum(d.tokens, {k: d.inputs[k] for k in needed}) for d in data], loss)
        while not p.advance(max_tokens=9):
            pass
        result = p.finish()
        ref_loss, ref_grads, _ = _peft_loss_and_grads(peft, named, data, loss)
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-5), loss
        got = _ours_as_peft(dict(zip(run.factors.named_tensors(), run.grads)))
        assert set(got) == set(ref_grads)
        for name, want in ref_grads.items():
            _close(got[name], want, f"{loss} grad {name}")
        run.grads = None
