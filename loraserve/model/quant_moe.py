"""Routed experts on a quantized base: an `ExpertLinear` whose E experts are `QuantLinear`s.

`--quantize int8|int4` quantizes every expert of every MoE layer as it quantizes a dense linear
(model/quant.py: the same scheme and group, the same kernels), so a Qwen3-MoE base keeps its
experts, which are most of its bytes, in 8 or 4 bits. The MoE block is unchanged: it calls the
module as it calls `ExpertLinear` (rows grouped by expert, one product per expert that has rows),
and LoRA's expert wrappers (serving: lora/layers.py; training: train/hooks.py) add their deltas
beside it in float, as for a dense quantized layer.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .moe import ExpertLinear
from .quant import QuantError, QuantLinear, Scheme, quantize_weight


class QuantExpertLinear(ExpertLinear):
    """y[i] = x[i] @ W[expert_ids[i]]^T with each expert's W a QuantLinear (ExpertLinear's
    contract: rows grouped by expert in ascending order). No gradient to the weights."""

    def __init__(self, experts: list[QuantLinear]):
        nn.Module.__init__(self)  # not ExpertLinear's: no float [E, out, in] weight
        if not experts or len({(q.out_features, q.in_features) for q in experts}) != 1:
            raise QuantError("quantized experts must be one or more of a single shape")
        self.num_experts = len(experts)
        self.out_features, self.in_features = experts[0].out_features, experts[0].in_features
        self.experts = nn.ModuleList(experts)

    @classmethod
    def of(cls, linear: ExpertLinear, scheme: Scheme) -> "QuantExpertLinear":
        """Every expert of a float ExpertLinear quantized under `scheme`."""
        parts = []
        for w in linear.weight.detach():
            codes, scales, mins, group = quantize_weight(w, scheme)
            parts.append(QuantLinear(codes, scales, mins, scheme.bits, group, linear.in_features))
        return cls(parts)

    @property
    def weight(self) -> Tensor:
        """The dequantized [E, out, in] weight (a copy, for code that reads one; not the hot path)."""
        return torch.stack([q.dequantized() for q in self.experts])

    def forward(self, x: Tensor, expert_ids: Tensor, token_index: Tensor) -> Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        start = 0
        for e, n in enumerate(self._counts(expert_ids)):
            if n:
                out[start:start + n] = self.experts[e](x[start:start + n])
                start += n
        return out

    def extra_repr(self) -> str:
        q = self.experts[0]
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, " \
               f"int{q.bits}, group={q.group}"
