"""AWQ and GPTQ checkpoints in Hugging Face format, repacked into `QuantLinear`s at load.

A directory whose `config.json` has a `quantization_config` with `quant_method` "awq" or "gptq"
holds, for each quantized linear `X` of out N and in K, in place of `X.weight`:

- `X.qweight` int32: 4-bit codes q, eight to an int32, value j in bits 4j..4j+3.
  AWQ ("gemm" version): [K, N / 8], packed along the outputs in the interleaved order
  AWQ_ORDER (int32 column c, nibble j holds output 8c + AWQ_ORDER[j]).
  GPTQ: [K / 8, N], packed along the inputs in order (row r, nibble j holds input 8r + j).
- `X.qzeros` int32 [K / G, N / 8]: zero points z per group of G inputs and output, packed along
  the outputs as the codes are (AWQ interleaved, GPTQ in order). GPTQ's v1 format (the default,
  `checkpoint_format` "gptq") stores z - 1, which is read back as stored + 1; "gptq_v2" stores z.
- `X.scales` float16 [K / G, N]: s per group and output.
- GPTQ `X.g_idx` int32 [K] (optional): the group of each input.

w[n, k] = s[g, n] (q[k, n] - z[g, n]), g = k // G, is our int4 layout (model/quant.py) with
group G, scale s and min -s z: the codes and scales are the file's; the min is the product s z
rounded once to float16 (within 2^-11 of |s z| relative), the only difference from the formula.
`group_size` -1 (GPTQ per output channel) is group K.

What is refused at start-up, with one line naming the file and what is wrong: another
quant_method, bits other than 4, another AWQ version or GPTQ format, a group that is no multiple
of 32 (the kernel's) or does not divide a layer's inputs, tensors of the wrong shape, non-finite
scales (or mins that overflow float16), and a GPTQ `g_idx` that is not consecutive groups of
inputs (desc_act=True, "act-order": its groups would need the input permuted on every call;
quantize with desc_act=False). The loader (model/loader.py) builds each quantized linear with
`quant_linear`, a MoE layer's quantized experts as a QuantExpertLinear of them; a layer whose
inputs are no multiple of 64 (the kernel's step) is served as its dequantized float weight
(logged). The served base's quantization is named `awq-int4-g128` / `gptq-int4-g128`.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .quant import CHUNK, QuantError, QuantLinear, pack_codes

log = logging.getLogger(__name__)

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ "gemm": nibble j of an int32 holds output AWQ_ORDER[j]
_AWQ_UNPACK = [AWQ_ORDER.index(c) for c in range(8)]  # output c is nibble _AWQ_UNPACK[c]
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what is added to a stored zero
PARTS = ("qweight", "qzeros", "scales", "g_idx")
_PACK = 8  # 4-bit codes per int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)

# reads a checkpoint tensor by name, checked against a shape: (name, shape) -> CPU tensor
Read = Callable[[str, tuple[int, ...]], Tensor]


@dataclass(frozen=True, slots=True)
class HFQuantization:
    """A checkpoint's `quantization_config` (bits 4): method "awq" | "gptq", group G inputs per
    scale (0: per output channel), zero_offset added to a stored zero, desc_act as declared."""

    method: str
    group: int
    zero_offset: int
    desc_act: bool

    @property
    def name(self) -> str:
        """What the base fingerprint and the logs call it: awq-int4-g128, gptq-int4-channel."""
        return f"{self.method}-int4-" + (f"g{self.group}" if self.group else "channel")

    def group_of(self, k: int) -> int:
        return self.group or k


def read_quantization(model_dir: str | Path) -> HFQuantization | None:
    """The AWQ/GPTQ quantization `model_dir/config.json` declares, None for a float checkpoint;
    QuantError naming config.json and the setting for one loraserve does not serve."""
    file = Path(model_dir) / "config.json"
    qc = json.loads(file.read_text()).get("quantization_config") if file.is_file() else None
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise QuantError(f"{file}: quantization_config quant_method {method!r} is not served; loraserve "
                         f"reads {' and '.join(METHODS)} checkpoints (or a float one with --quantize int8|int4)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantError(f"{file}: {method} bits {bits!r} is not served; loraserve reads 4-bit {method} only")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise QuantError(f"{file}: {method} group_size {group!r} is not served; expected -1 or a multiple "
                         "of 32 (the quantized kernel's group)")
    offset = 0
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantError(f"{file}: awq version {version!r} is not served; loraserve reads the \"gemm\" packing")
    else:
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in _GPTQ_FORMATS:
            raise QuantError(f"{file}: gptq checkpoint_format {fmt!r} is not served; expected "
                             f"{' or '.join(_GPTQ_FORMATS)}")
        offset = _GPTQ_FORMATS[fmt]
    return HFQuantization(method, max(group, 0), offset, bool(qc.get("desc_act")))


def quantized_weights(names: Iterable[str]) -> dict[str, str]:
    """`X.weight` -> `X` for every `X.qweight` among a checkpoint's tensor names."""
    return {n.removesuffix("qweight") + "weight": n.removesuffix(".qweight") for n in names
            if n.endswith(".qweight")}


def is_part(name: str) -> bool:
    """Whether checkpoint tensor `name` is part of a quantized linear (PARTS)."""
    return name.rpartition(".")[2] in PARTS


def read_linear(q: HFQuantization, read: Read, prefix: str, n: int, k: int, file: Path,
                has_g_idx: bool) -> tuple[Tensor, Tensor, Tensor, int]:
    """(codes [N, K] uint8, scales and mins [N, K / G] float16, G) of quantized linear `prefix`
    (out N, in K) stored in `file` (module doc); QuantError naming the file for what is wrong."""
    group = q.group_of(k)
    if k % group:
        raise QuantError(f"{file}: {prefix}: {q.method} group_size {group} does not divide its {k} inputs")
    groups = k // group
    if q.method == "awq":
        codes = _unpack_awq(read(f"{prefix}.qweight", (k, n // _PACK)))              # [K, N]
        zeros = _unpack_awq(read(f"{prefix}.qzeros", (groups, n // _PACK)))          # [K / G, N]
    else:
        packed = read(f"{prefix}.qweight", (k // _PACK, n))
        codes = _nibbles(packed).permute(0, 2, 1).reshape(k, n)                      # [K, N]
        zeros = _nibbles(read(f"{prefix}.qzeros", (groups, n // _PACK))).reshape(groups, n) + q.zero_offset
        if has_g_idx:
            _check_g_idx(read(f"{prefix}.g_idx", (k,)), group, prefix, file, q)
    scales = read(f"{prefix}.scales", (groups, n)).to(torch.float16)
    if not torch.isfinite(scales).all():
        raise QuantError(f"{file}: {prefix}.scales holds non-finite values (a corrupt checkpoint?)")
    mins = -(scales.float() * zeros.float())
    if not torch.isfinite(mins.half()).all():
        raise QuantError(f"{file}: {prefix}: scale x zero point overflows float16")
    return (codes.t().to(torch.uint8).contiguous(), scales.t().contiguous(), mins.half().t().contiguous(), group)


def quant_linear(q: HFQuantization, read: Read, prefix: str, n: int, k: int, file: Path, has_g_idx: bool,
                 bias: Tensor | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The served layer of quantized linear `prefix`: a QuantLinear, or an nn.Linear of its
    dequantized weight where K is no multiple of the kernel's step (logged)."""
    codes, scales, mins, group = read_linear(q, read, prefix, n, k, file, has_g_idx)
    if k % CHUNK:
        log.info("%s: %d inputs are no multiple of %d: served as its dequantized float weight", prefix, k, CHUNK)
        layer = nn.Linear(k, n, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(dequantize(codes, scales, mins, group).to(device, dtype), requires_grad=False)
        layer.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        return layer
    return QuantLinear(pack_codes(codes, 4).to(device), scales.to(device), mins.to(device), 4, group, k,
                       None if bias is None else bias.detach())


def dequantize(codes: Tensor, scales: Tensor, mins: Tensor, group: int) -> Tensor:
    """The float32 [N, K] weight of unpacked codes [N, K] and scales, mins [N, K / G]."""
    n, k = codes.shape
    w = codes.float().view(n, k // group, group) * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return w.view(n, k)


def _nibbles(packed: Tensor) -> Tensor:
    """int32 [R, C] -> uint8 [R, C, 8]: nibble j of each int32 (bits 4j..4j+3)."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0x0F).to(torch.uint8)


def _unpack_awq(packed: Tensor) -> Tensor:
    """AWQ int32 [R, C / 8] -> uint8 [R, C] in output order (nibbles un-interleaved)."""
    nib = _nibbles(packed)
    return nib[..., _AWQ_UNPACK].reshape(packed.shape[0], -1)


def _check_g_idx(g_idx: Tensor, group: int, prefix: str, file: Path, q: HFQuantization) -> None:
    """QuantError unless g_idx puts input k in group k // G (what desc_act=False writes)."""
    expected = torch.arange(g_idx.numel()) // group
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise QuantError(f"{file}: {prefix}.g_idx does not group consecutive inputs (desc_act={q.desc_act}: "
                         "act-order); loraserve serves GPTQ checkpoints quantized with desc_act=False")
