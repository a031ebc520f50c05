"""A GGUF file's quantized linears repacked into `QuantLinear`s at load, not dequantized.

`serve --model file.gguf` converts the file into a Hugging Face directory (model/gguf.py); the
engine loads that directory's float tensors lazily (views of its file mapping) and, where the
file's linears are quantized, `repack_gguf` replaces each projection (and the head; a tied head
from `token_embd`) by the file's own blocks in our layout: Q8_0 (int8, group 32), Q4_0 (int4,
min = -8 d) and Q4_1 (int4, scale and min) map exactly, so the served weights are the ones the
dequantized directory holds, bit for bit. F32/F16/BF16 linears stay float; any other type (the
K-quants) refuses at start-up with one line naming the tensor, its type and the file
(`--quantize none` serves such a file dequantized). Blocks are read with plain file reads, so
the file's pages are not kept mapped beside the packed copies. Non-finite scales refuse too.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .gguf import _GLOBAL_TENSORS, _LAYER_TENSORS, _PERMUTED_ARCHS, MARKER, GGUFError, _open_reader, _unpermute
from .quant import CHUNK, QuantLinear, pack_codes

REPACKED = ("Q8_0", "Q4_0", "Q4_1")  # GGUF types served quantized
FLOAT_TYPES = ("F32", "F16", "BF16")
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK = 32  # inputs per block of every repacked type


def source_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from (its MARKER names it), if it still exists."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text()).get("source", ""))
    return source if source.is_file() else None


def linear_types(path: Path) -> set[str]:
    """The GGUF types of the file's projection and head tensors."""
    reader = _open_reader(path)
    return {t.tensor_type.name for t in reader.tensors if _linear_name(t.name) is not None}


def _linear_name(name: str) -> str | None:
    """The module path of the linear a GGUF tensor holds (the tied head from token_embd), else None."""
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PROJECTIONS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def repack_gguf(model: nn.Module, path: Path, arch: str) -> str | None:
    """Replace model's linears by the quantized blocks of GGUF file `path`, in place, before
    fusing. Returns the quantization's name ("gguf-Q4_1+Q8_0"), or None when the file's linears
    are all float (nothing to repack). GGUFError naming the tensor and the file otherwise."""
    reader = _open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    wanted = {_linear_name(n): t for n, t in tensors.items() if _linear_name(n) is not None}
    tied = "lm_head" not in wanted
    if tied:
        wanted["lm_head"] = tensors[f"{_GLOBAL_TENSORS_INV['model.embed_tokens']}.weight"]
    types = {t.tensor_type.name for t in wanted.values()}
    for module_path, t in wanted.items():
        kind = t.tensor_type.name
        if kind not in REPACKED + FLOAT_TYPES:
            raise GGUFError(f"{path}: tensor {t.name} is {kind}, which loraserve serves quantized only "
                            f"as {', '.join(REPACKED)} (or float); serve it dequantized with --quantize none")
    if not types & set(REPACKED):
        return None
    config = model.config
    with open(path, "rb") as f:
        for module_path, t in sorted(wanted.items()):
            kind = t.tensor_type.name
            if kind in FLOAT_TYPES:
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
    return "gguf-" + "+".join(sorted(types & set(REPACKED)))


_GLOBAL_TENSORS_INV = {v: k for k, v in _GLOBAL_TENSORS.items()}


def _repacked(path: Path, f, t, kind: str, n: int, k: int, heads: int | None, bias) -> QuantLinear:
    """The QuantLinear of one GGUF tensor's blocks, its rows un-permuted for llama's Q/K."""
    f.seek(int(t.data_offset))
    raw = np.frombuffer(f.read(int(t.n_bytes)), dtype=np.uint8)
    codes, scales, mins, bits = _blocks(raw, kind, n, k)
    if not (np.isfinite(scales).all() and np.isfinite(mins).all()):
        raise GGUFError(f"{path}: tensor {t.name} has non-finite scales (a corrupt file?)")
    if heads is not None:
        codes, scales, mins = (np.ascontiguousarray(_unpermute(a, heads)) for a in (codes, scales, mins))
    packed = pack_codes(torch.from_numpy(codes), bits)
    return QuantLinear(packed, torch.from_numpy(scales), torch.from_numpy(mins), bits, _BLOCK, k,
                       None if bias is None else bias.detach().clone())


def _blocks(raw: np.ndarray, kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(codes [n, k] uint8, scales and mins [n, k / 32] float16, bits) of GGUF blocks."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    blocks = raw.reshape(n, k // _BLOCK, size)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        return q.astype(np.uint8).reshape(n, k), d, (d.astype(np.float32) * -128).astype(np.float16), 8
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # 16 bytes: j low, j + 16 high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    if kind == "Q4_1":
        return codes, d, np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0], 4
    return codes, d, (d.astype(np.float32) * -8).astype(np.float16), 4
