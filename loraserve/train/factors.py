"""A run's LoRA factors: one (A [r, in], B [out, r]) pair per target module, float32 masters.

Initialised as PEFT initialises LoRA (A kaiming-uniform with a = sqrt(5), so U(-1/sqrt(in),
1/sqrt(in)); B zero), drawn from a generator seeded by the run's seed in a fixed module order,
so a seed names the initial factors. `serving_weights` turns them into the catalog's serving
layout (scale folded into B, the serving dtype): the same layout `catalog.export` makes of a
PEFT adapter, so a run's revision and an imported one are served alike.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from loraserve.catalog.export import fold
from loraserve.catalog.layout import AdapterWeights
from loraserve.catalog.targets import EXPERT_KINDS, module_path, parse_module_path, tensor_names
from loraserve.model import CausalLM
from loraserve.train.config import ATTENTION_KINDS, RunConfig


def peft_init(rank: int, fan_in: int, fan_out: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's LoRA init: A [rank, in] ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)),
    B [out, rank] zero. The one copy of the rule (train_lora's demo adapters draw it too)."""
    bound = 1.0 / math.sqrt(fan_in)
    a = torch.rand(rank, fan_in, generator=gen) * 2 * bound - bound
    return a, torch.zeros(fan_out, rank)


def _shape(model: CausalLM, path: str) -> tuple[int, int, int | None]:
    """(in, out, experts or None) of the target module at catalog module path `path` (wrappers
    and packing aside)."""
    module = model.get_submodule(path if path == "lm_head" else f"model.{path}")
    inner = getattr(module, "base", module)  # a serving LoRA wrapper keeps its target as .base
    return inner.in_features, inner.out_features, getattr(inner, "num_experts", None)


def _init(rank: int, path: str, model: CausalLM, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's init of one target: a Linear's A [r, in], B [out, r]; packed experts' A [E, r, in],
    B [E, out, r], drawn as PEFT draws `target_parameters` on an expert stack (A one [E*r, in]
    kaiming-uniform matrix, B zero)."""
    fan_in, fan_out, experts = _shape(model, path)
    if experts is None:
        return peft_init(rank, fan_in, fan_out, gen)
    a, _ = peft_init(rank * experts, fan_in, fan_out, gen)
    return a.view(experts, rank, fan_in), torch.zeros(experts, fan_out, rank)


class LoRAFactors:
    """The trainable tensors of one run, keyed by catalog module path (`layers.0.self_attn.q_proj`)."""

    def __init__(self, model: CausalLM, config: RunConfig, device: torch.device | None = None):
        self.config = config
        mc = model.config
        moe_layers = [mc.is_moe_layer(l) for l in range(mc.num_layers)]
        self.kinds = config.kinds(dense_mlp=not all(moe_layers), experts=any(moe_layers))
        device = device or model.model.embed_tokens.weight.device
        gen = torch.Generator().manual_seed(config.seed)
        self.pairs: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for path in self._paths(moe_layers):
            a, b = _init(config.rank, path, model, gen)
            self.pairs[path] = (nn.Parameter(a.to(device)), nn.Parameter(b.to(device)))

    def _paths(self, moe_layers: list[bool]) -> list[str]:
        """Each layer's targets (its dense MLP or its experts, as the layer has), then lm_head."""
        def in_layer(kind: str, moe: bool) -> bool:
            return kind in ATTENTION_KINDS or (kind != "lm_head" and (kind in EXPERT_KINDS) == moe)

        paths = [module_path(k, l) for l, moe in enumerate(moe_layers) for k in self.kinds if in_layer(k, moe)]
        return paths + (["lm_head"] if "lm_head" in self.kinds else [])

    def parameters(self) -> list[nn.Parameter]:
        """Every factor, A then B per module, in module order (the optimizer's order)."""
        return [p for pair in self.pairs.values() for p in pair]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Blob-style names (`layers.0.self_attn.q_proj.lora_A`) -> the factor (unscaled)."""
        out = {}
        for path, (a, b) in self.pairs.items():
            a_name, b_name = tensor_names(*parse_module_path(path))
            out[a_name], out[b_name] = a, b
        return out

    @torch.no_grad()
    def load_named(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy saved factors in; ValueError unless names and shapes are exactly this run's."""
        mine = self.named_tensors()
        if set(tensors) != set(mine):
            raise ValueError(f"saved factors name {len(tensors)} tensors, this run has {len(mine)} "
                             "(another rank, base or target set)")
        for name, t in mine.items():
            if tensors[name].shape != t.shape:
                raise ValueError(f"{name}: saved shape {list(tensors[name].shape)}, run has {list(t.shape)}")
            t.copy_(tensors[name])

    @torch.no_grad()
    def gains(self) -> list[tuple[str, float, float]]:
        """(module path, gain, largest |value|) of each target as served: B scaled by alpha/r
        (`catalog.bounds.pair_gain` on the serving layout: rank x max|B| x ||A||_inf, per expert
        for packed experts), float64, so a gain past float32's range is still a number."""
        out = []
        for path, (a, b) in self.pairs.items():
            a64, b64 = a.detach().double().abs(), b.detach().double().abs() * self.config.scale
            ga = a64.sum(-1).amax(-1)                                   # [] or [E]
            gb = a.shape[-2] * b64.flatten(-2).amax(-1)                 # [] or [E]
            # a NaN or Inf anywhere makes the gain NaN or Inf (float64 holds every finite one)
            out.append((path, float((ga * gb).max()), float(torch.maximum(a64.max(), b64.max()))))
        return out

    @torch.no_grad()
    def serving_weights(self, base_fingerprint: str, dtype: torch.dtype, source: str) -> AdapterWeights:
        """The serving layout of the current factors: A cast, B * alpha/r folded and cast once;
        CPU tensors of their own (the CPU tier may serve them while the run trains on)."""
        tensors = {}
        for path, (a, b) in self.pairs.items():
            a_name, b_name = tensor_names(*parse_module_path(path))
            tensors[a_name] = a.detach().to("cpu", dtype, copy=True).contiguous()
            tensors[b_name] = fold(b.detach().float(), self.config.scale, dtype).cpu().contiguous()
        return AdapterWeights(base_fingerprint, self.config.rank, list(self.kinds), dtype, tensors, source)
