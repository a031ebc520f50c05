"""A GGUF file's quantized linears repacked into `QuantLinear`s at load, not dequantized.

`serve --model file.gguf` converts the file into a Hugging Face directory (model/gguf.py); the
engine loads that directory's float tensors lazily (views of its file mapping) and, where the
file's linears are quantized, `repack_gguf` replaces each projection (and the head; a tied head
from `token_embd`) by the file's own blocks in our layout (model/quant.py):

- Q8_0 (int8, group 32), Q4_0 (int4, min = -8 d) and Q4_1 (int4, scale and min) map exactly: the
  served weights are the ones the dequantized directory holds, bit for bit.
- Q4_K: each 256-value super-block is 8 sub-blocks of 32 with 6-bit scale and min indices,
  w = d sc_j q - dmin m_j, q 4 bits: int4, group 32, scale = d sc_j, min = -dmin m_j. The products
  are exact in float32 (11 x 6 bits) and rounded once to float16 (round to nearest even): within
  2^-11 relative of each sub-block's scale and min (2^-25 absolute below float16's normal range),
  the only difference from the dequantized weights. Q4_K's nibbles are already our order (byte j
  of each 64 values: value j low, j + 32 high).
- Q5_K: the same with 5-bit q: int8 codes (0..31), group 32, scale and min as Q4_K. 8 bits a
  weight instead of 5.5 (+1 for the float16 scale and min per 32), still the file's values.
- Q6_K (w = d sc_j (q - 32), int8 scale per 16 values): no exact layout: the kernel's groups are
  multiples of 32 and two 16-value sub-blocks' scales do not share one; a requantization would
  add error. Its linears stay as loaded, the file's values dequantized to the serving float dtype,
  with one log line naming them. llama.cpp's Q4_K_M recipe (Q6_K head and some ffn_down) serves
  so: Q4_K repacked, the Q6_K tensors float.

A MoE file's packed expert tensors (`ffn_{gate,up,down}_exps`, [E, out, in]) are repacked the
same way, one QuantLinear per expert plane, into a QuantExpertLinear (model/quant_moe.py); the
router (`ffn_gate_inp`) stays float.

F32/F16/BF16 linears stay float; any other type refuses at start-up with one line naming the
tensor, its type and the file (`--quantize none` serves such a file dequantized). Blocks are read
with plain file reads, so the file's pages are not kept mapped beside the packed copies.
Non-finite scales or mins (or K-quant products that overflow float16) refuse too.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from .gguf import (_EXPERT_TENSORS, _GLOBAL_TENSORS, _LAYER_TENSORS, _PERMUTED_ARCHS, MARKER, GGUFError,
                   _open_reader, _unpermute)
from .quant import CHUNK, QuantLinear, pack_codes
from .quant_moe import QuantExpertLinear

log = logging.getLogger(__name__)

REPACKED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K")  # GGUF types served quantized
KEPT_FLOAT = ("Q6_K",)  # quantized in the file, served as the loaded float weights (module doc)
FLOAT_TYPES = ("F32", "F16", "BF16")
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK = 32  # inputs per scale of every repacked type (a K-quant's sub-block)
_BYTES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q5_K": (256, 176)}


def source_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from (its MARKER names it), if it still exists."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text()).get("source", ""))
    if source.is_file():
        return source
    log.warning("%s: the GGUF file it was converted from, %s, is gone: its linears are served as "
                "the directory's dequantized float weights (serve the .gguf file itself to serve it "
                "quantized)", model_dir, source)
    return None


def linear_types(path: Path) -> set[str]:
    """The GGUF types of the file's projection and head tensors."""
    reader = _open_reader(path)
    return {t.tensor_type.name for t in reader.tensors
            if _linear_name(t.name) is not None or _experts_name(t.name) is not None}


def _linear_name(name: str) -> str | None:
    """The module path of the linear a GGUF tensor holds (the tied head from token_embd), else None."""
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PROJECTIONS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _experts_name(name: str) -> str | None:
    """The module path of the ExpertLinear a packed [E, out, in] GGUF tensor holds, else None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_TENSORS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.mlp.experts.{_EXPERT_TENSORS[parts[2]]}"
    return None


def repack_gguf(model: nn.Module, path: Path, arch: str) -> str | None:
    """Replace model's linears by the quantized blocks of GGUF file `path`, in place, before
    fusing. Returns the quantization's name, the file's quantized linear types ("gguf-Q4_1+Q8_0",
    "gguf-Q4_K+Q6_K"), or None when they are all float. GGUFError naming the tensor and the file
    for a type that cannot be served quantized."""
    reader = _open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    wanted = {_linear_name(n): t for n, t in tensors.items() if _linear_name(n) is not None}
    if "lm_head" not in wanted:  # tied
        wanted["lm_head"] = tensors[f"{_GLOBAL_TENSORS_INV['model.embed_tokens']}.weight"]
    experts = {_experts_name(n): t for n, t in tensors.items() if _experts_name(n) is not None}
    types = {t.tensor_type.name for t in [*wanted.values(), *experts.values()]}
    for module_path, t in [*wanted.items(), *experts.items()]:
        kind = t.tensor_type.name
        if kind not in REPACKED + KEPT_FLOAT + FLOAT_TYPES:
            raise GGUFError(f"{path}: tensor {t.name} is {kind}, which loraserve serves quantized only "
                            f"as {', '.join(REPACKED)} (or float); serve it dequantized with --quantize none")
    quantized = types - set(FLOAT_TYPES)
    if not quantized:
        return None
    kept = sorted(t.name for t in [*wanted.values(), *experts.values()] if t.tensor_type.name in KEPT_FLOAT)
    if kept:
        log.info("%s: %s served as float, dequantized at load: %s (a scale per 16 values) has no exact "
                 "layout in the quantized kernel's groups of 32", path, ", ".join(kept), "/".join(KEPT_FLOAT))
    config = model.config
    with open(path, "rb") as f:
        for module_path, t in sorted(wanted.items()):
            kind = t.tensor_type.name
            if kind not in REPACKED:
                continue
            heads = None
            if arch in _PERMUTED_ARCHS and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            old = model.get_submodule(module_path)
            n, k = (int(d) for d in reversed(t.shape.tolist()))
            if k % CHUNK:
                continue  # the kernel's step: stays float (the dequantized weights are loaded)
            layer = _repacked(path, f, t, kind, n, k, heads, getattr(old, "bias", None))
            owner, _, attr = module_path.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, layer)
        for module_path, t in sorted(experts.items()):
            e, n, k = (int(d) for d in reversed(t.shape.tolist()))
            if t.tensor_type.name not in REPACKED or k % CHUNK:
                continue  # float, or not the kernel's step: stays as loaded
            per_expert = int(t.n_bytes) // e
            layer = QuantExpertLinear([_repacked(path, f, t, t.tensor_type.name, n, k, None, None,
                                                 offset=i * per_expert, n_bytes=per_expert) for i in range(e)])
            owner, _, attr = module_path.rpartition(".")
            setattr(model.get_submodule(owner), attr, layer)
    return "gguf-" + "+".join(sorted(quantized))


_GLOBAL_TENSORS_INV = {v: k for k, v in _GLOBAL_TENSORS.items()}


def _repacked(path: Path, f, t, kind: str, n: int, k: int, heads: int | None, bias, *, offset: int = 0,
              n_bytes: int | None = None) -> QuantLinear:
    """The QuantLinear of one GGUF tensor's blocks (or of `n_bytes` of them from `offset`: one
    expert's plane of a packed expert tensor), its rows un-permuted for llama's Q/K."""
    f.seek(int(t.data_offset) + offset)
    raw = np.frombuffer(f.read(int(t.n_bytes) if n_bytes is None else n_bytes), dtype=np.uint8)
    values, size = _BYTES[kind]
    blocks = raw.reshape(n * k // values, size)
    with np.errstate(all="ignore"):  # a float16 overflow or a NaN is refused just below
        codes, scales, mins, bits = (_k_blocks if values == 256 else _blocks)(blocks, kind)
    if not (np.isfinite(scales).all() and np.isfinite(mins).all()):
        raise GGUFError(f"{path}: tensor {t.name} has non-finite scales or mins (a corrupt file?)")
    codes, scales, mins = codes.reshape(n, k), scales.reshape(n, k // _BLOCK), mins.reshape(n, k // _BLOCK)
    if heads is not None:
        codes, scales, mins = (np.ascontiguousarray(_unpermute(a, heads)) for a in (codes, scales, mins))
    packed = pack_codes(torch.from_numpy(codes), bits)
    return QuantLinear(packed, torch.from_numpy(scales), torch.from_numpy(mins), bits, _BLOCK, k,
                       None if bias is None else bias.detach().clone())


def _f16(a: np.ndarray) -> np.ndarray:
    """Two bytes per row of a uint8 array as float16 [B]."""
    return np.ascontiguousarray(a).view(np.float16)[:, 0]


def _blocks(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(codes [B, 32] uint8, scales and mins [B] float16, bits) of B blocks of 32 values."""
    d = _f16(blocks[:, :2])
    if kind == "Q8_0":
        q = blocks[:, 2:].view(np.int8).astype(np.int16) + 128
        return q.astype(np.uint8), d, (d.astype(np.float32) * -128).astype(np.float16), 8
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]  # 16 bytes: j low, j + 16 high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    if kind == "Q4_1":
        return codes, d, _f16(blocks[:, 2:4]), 4
    return codes, d, (d.astype(np.float32) * -8).astype(np.float16), 4


def _k_blocks(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(codes [B, 256] uint8, scales and mins [B, 8] float16, bits) of B Q4_K / Q5_K super-blocks:
    d, dmin (float16), 12 bytes of 6-bit scale and min indices (unpacked by the gguf package's
    own `Q4_K.get_scale_min`), Q5_K's 32 bytes of high bits (bit j of byte l: sub-block j's
    value l), 128 bytes of nibbles (byte l of each 32: value l of sub-block 2c low, of 2c + 1 high)."""
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2]).astype(np.float32)[:, None]
    dmin = _f16(blocks[:, 2:4]).astype(np.float32)[:, None]
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    scales = (d * sc).astype(np.float16)  # exact in float32, one rounding to float16
    mins = (-(dmin * m)).astype(np.float16)
    qs = blocks[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, 256)
    if kind == "Q4_K":
        return codes, scales, mins, 4
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return codes | ((qh & 1).reshape(n, 256) << 4), scales, mins, 8
