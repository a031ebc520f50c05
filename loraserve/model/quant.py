"""Weight-only quantized base linears, LoRA in float: y = W_q x + B A x, as QLoRA serves.

One layout for every scheme (`QuantLinear`): unsigned codes, w = scale * q + min per group of
`group` inputs of one output row, scale and min float16 [out, in / group]. 4-bit codes are
packed two to a byte, byte j of each 64-input chunk holding input j (low nibble) and j + 32
(high); 8-bit codes one to a byte. What maps onto it:

- `int8` (`--quantize int8`): per output channel (group = in), symmetric: q = round(w / s) + 128,
  min = -128 s. `int8` with a group of 32/64/128 too (GGUF Q8_0 is int8, group 32).
- `int4` (`--quantize int4 --quantize-group G`): per group, asymmetric as GGUF Q4_1:
  s = (max - min) / 15, q = round((w - min) / s). GGUF Q4_1 maps exactly, Q4_0 (w = d (q - 8))
  with min = -8 d.

The LoRA wrappers see an ordinary projection (`in_features`, `out_features`, forward(x)); its
delta runs beside this layer unchanged. Which kernel multiplies is chosen by rows per call from
the measured table `KERNELS` (bench/quant_kernels.py): the project's own AVX-512 kernel
(kernels/cpu_quant, float activations) for decode's few rows, a float GEMM over the weight
dequantized per call for prefill's many. A linear whose inputs are no multiple of 64 stays float
(logged).

Training through the base (QLoRA, train/): a call whose input needs a gradient multiplies as
serving does (same rows, same kernel: the logits training sees are the ones served), and its
backward gives the input dx = dy W, W dequantized a slice of output rows at a time
(`QuantLinear.input_grad`); nothing is kept between the two but a reference to the layer, and
codes, scales and mins get no gradient.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..kernels import cpu_quant

log = logging.getLogger(__name__)

GROUPS = (32, 64, 128)
# Rows per call up to which the kernel (kernels/cpu_quant, float activations) serves, per scheme;
# above, a float GEMM over the weight dequantized per call. From bench/quant_kernels.py on the
# 2-core AVX-512 dev machine (bench/RESULTS.md, "Quantized bases" and session 13): once the kernel
# library was built with OpenMP (both cores; it had run on one), the table kernel beat
# "dequantize + F.linear" at every row count measured, 1.9-2.1x at 16-64 rows, 1.45-1.5x at 128
# and 1.15-1.35x at 256 (SmolLM2 gate_up/down, Qwen3-0.6B down; int4-g32 and int8), so decode
# batches and short prefills stay on it; longer prefills (not measured past 256) dequantize.
KERNELS = {"int4": 256, "int8": 256}
CHUNK = 64  # inputs per packed chunk (the kernel's step)
# Float bytes of the weight one step of the input gradient dequantizes (`QuantLinear.input_grad`):
# a slice of output rows, so a backward never holds a layer's whole float weight.
BACKWARD_SLICE_BYTES = 8 << 20


class QuantError(ValueError):
    """A weight that cannot be quantized as asked (non-finite values, a bad group)."""


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a base is quantized: bits 4|8, group inputs per scale (0: per output channel)."""

    bits: int
    group: int = 0

    @classmethod
    def parse(cls, name: str, group: int | None) -> "Scheme":
        """`int8` (per channel unless a group is given) or `int4` (group default DEFAULT_INT4_GROUP)."""
        if name not in ("int8", "int4"):
            raise QuantError(f"unknown quantization {name!r}; expected int8 or int4")
        if group is not None and group not in GROUPS:
            raise QuantError(f"unsupported quantization group size {group}; expected one of {GROUPS}")
        if name == "int4":
            return cls(4, group or DEFAULT_INT4_GROUP)
        return cls(8, group or 0)

    @property
    def name(self) -> str:
        """What the base fingerprint and the logs call it: int8-channel, int4-g64, ..."""
        return f"int{self.bits}-" + ("channel" if self.group == 0 else f"g{self.group}")


# Chosen by bench/quant_kernels.py: group 32 read slower at decode shapes (a scale and a min per
# 32 inputs: 1 bit a weight more than 64), 64 and 128 the same speed; 64 is the smaller error.
DEFAULT_INT4_GROUP = 64


class QuantLinear(nn.Module):
    """A linear layer held as packed codes with float16 scales and mins (module doc).
    x [..., in] -> [..., out] in x's dtype; no gradients to the weight (LoRA's factors train)."""

    def __init__(self, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group: int,
                 in_features: int, bias: Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, codes.shape[0]
        self.bits, self.group = bits, group
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("mins", mins.to(torch.float16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.native = codes.device.type == "cpu" and cpu_quant.available()
        self.max_rows = KERNELS[f"int{bits}"]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The [out, in] weight the codes stand for (a new tensor: prefill's GEMM and tests)."""
        return self.dequantized_rows(0, self.out_features, dtype)

    def dequantized_rows(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows start..end-1 of the dequantized weight: [end - start, in], a new tensor."""
        codes, scales, mins = self.codes[start:end], self.scales[start:end], self.mins[start:end]
        if self.native:
            return cpu_quant.dequantize(codes, scales, mins, self.bits, self.in_features, self.group).to(dtype)
        q = unpack_codes(codes, self.bits, self.in_features).to(torch.float32)
        n, g = codes.shape[0], self.group
        w = q.view(n, -1, g) * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
        return w.view(n, self.in_features).to(dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (a copy, for code that reads a weight; not the hot path)."""
        return self.dequantized()

    def forward(self, x: Tensor) -> Tensor:
        if (self.native and x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= self.max_rows
                and self.bias is None and not (x.requires_grad and torch.is_grad_enabled())
                and x.is_contiguous()):
            # decode's few float rows: the kernel and nothing else (one dispatched op, not five)
            return cpu_quant.quant_linear(x, self.codes, self.scales, self.mins, self.bits, self.group)
        rows = x.reshape(-1, self.in_features)
        if rows.requires_grad and torch.is_grad_enabled():
            y = _InputGrad.apply(rows, self)
        else:
            y = self.product(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: Tensor) -> Tensor:
        """rows [M, in] -> [M, out] in rows' dtype, bias added: the kernel up to `max_rows` rows,
        else a GEMM over the dequantized weight (module doc). Not differentiable (forward is)."""
        if self.native and rows.shape[0] <= self.max_rows:
            y = cpu_quant.quant_linear(rows.float().contiguous(), self.codes, self.scales, self.mins,
                                       self.bits, self.group).to(rows.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(rows, self.dequantized(rows.dtype), self.bias)

    def input_grad(self, dy: Tensor) -> Tensor:
        """dx = dy W: dy [M, out] -> [M, in] in dy's dtype, W dequantized BACKWARD_SLICE_BYTES of
        output rows at a time (each slice dropped before the next is made), summed in float32
        at least (a 16-bit dy's slices are not rounded one by one)."""
        acc = torch.promote_types(dy.dtype, torch.float32)
        step = max(1, BACKWARD_SLICE_BYTES // (self.in_features * acc.itemsize))
        dx = dy.new_zeros((dy.shape[0], self.in_features), dtype=acc)
        for s in range(0, self.out_features, step):
            e = min(s + step, self.out_features)
            dx.addmm_(dy[:, s:e].to(acc), self.dequantized_rows(s, e, acc))
        return dx.to(dy.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group={self.group}, bias={self.bias is not None}, kernel="
                + ("table" if self.native else "dequantize"))  # cpu_quant's served kernel, or torch ops

    @classmethod
    def cat(cls, parts: list["QuantLinear"]) -> "QuantLinear":
        """One layer of `parts` (same input, bits and group) stacked along the output axis."""
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias if p.bias is not None else p.scales.new_zeros(p.out_features, dtype=torch.float32)
                              for p in parts])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                   torch.cat([p.mins for p in parts]), parts[0].bits, parts[0].group, parts[0].in_features, bias)


class _InputGrad(torch.autograd.Function):
    """y = layer.product(x), differentiable in x: backward dx = layer.input_grad(dy). Saves no
    tensor (the codes are read again in backward); the layer has no trainable weight."""

    @staticmethod
    def forward(ctx, rows: Tensor, layer: QuantLinear) -> Tensor:
        ctx.layer = layer
        return layer.product(rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        return ctx.layer.input_grad(dy), None


def fusable(parts: list[nn.Module]) -> bool:
    """Whether `parts` are QuantLinears `QuantLinear.cat` can stack."""
    return (all(type(p) is QuantLinear for p in parts)
            and len({(p.in_features, p.bits, p.group) for p in parts}) == 1)


# -- packing ---------------------------------------------------------------------------------------
def pack_codes(q: Tensor, bits: int) -> Tensor:
    """Codes [N, K] uint8 (values < 2**bits) -> the stored layout (module doc)."""
    q = q.to(torch.uint8).contiguous()
    if bits == 8:
        return q
    n, k = q.shape
    chunks = q.view(n, k // CHUNK, 2, CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(codes: Tensor, bits: int, k: int) -> Tensor:
    """The stored layout -> codes [N, K] uint8."""
    if bits == 8:
        return codes
    n = codes.shape[0]
    packed = codes.view(n, k // CHUNK, 1, CHUNK // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=2).view(n, k)


def quantize_weight(w: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor, Tensor, int]:
    """(codes, scales, mins, group) of float weight w [N, K] under `scheme` (module doc); the
    scale and min are rounded to float16 before the codes are chosen, so the codes fit them."""
    w = w.detach().float()
    n, k = w.shape
    if k % CHUNK:
        raise QuantError(f"{k} inputs are no multiple of {CHUNK}")
    group = fitting_group(scheme.group, k)
    if not torch.isfinite(w).all():
        raise QuantError("the weight holds non-finite values")
    blocks = w.view(n, k // group, group)
    if scheme.bits == 8:
        scale = (blocks.abs().amax(-1) / 127).to(torch.float16).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / scale.unsqueeze(-1)).clamp(-127, 127) + 128
        mins = -128 * scale
    else:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        scale = ((hi - lo) / 15).to(torch.float16).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        mins = lo.to(torch.float16).float()
        q = torch.round((blocks - mins.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    if not (torch.isfinite(scale.half()).all() and torch.isfinite(mins.half()).all()):
        raise QuantError("its scales overflow float16")
    return pack_codes(q.view(n, k), scheme.bits), scale.half(), mins.half(), group


def fitting_group(group: int, k: int) -> int:
    """`group` (0: all k inputs), or the largest of GROUPS below it that divides k: a 576-input
    layer (SmolLM2's hidden size) takes group 64 when 128 is asked."""
    if group == 0:
        return k
    return next(g for g in sorted(GROUPS, reverse=True) if g <= group and k % g == 0)


def quant_linear_of(linear: nn.Linear, scheme: Scheme) -> QuantLinear:
    """The QuantLinear of a float nn.Linear."""
    codes, scales, mins, group = quantize_weight(linear.weight, scheme)
    return QuantLinear(codes, scales, mins, scheme.bits, group, linear.in_features, linear.bias)
