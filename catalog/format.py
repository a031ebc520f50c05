"""The adapter blob format, torch-free: target kinds, tensor names, header, checksum.

A revision blob is one safetensors file (docs/INTERNALS.md §1). Tensor names mirror the
Hugging Face module path without `model.`:

    layers.{l}.self_attn.{q,k,v,o}_proj.lora_A [R, in]      .lora_B [out, R]
    layers.{l}.mlp.{gate,up,down}_proj.lora_A   [R, in]      .lora_B [out, R]
    layers.{l}.mlp.experts.{proj}.lora_A        [E, R, in]   .lora_B [E, out, R]
    lm_head.lora_A                              [R, H]       .lora_B [V, R]

`__metadata__` (all strings): format, base_fingerprint, rank, targets (comma-separated
kinds), dtype, source. This module parses headers without torch so the store and the bulk
materializer stay light.
"""
from __future__ import annotations

import json
import struct

import xxhash

from .errors import CorruptBlob

FORMAT = "loraserve.adapter.v1"
ATTN_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_KINDS = ("gate_proj", "up_proj", "down_proj")
EXPERT_KINDS = tuple(f"experts.{p}" for p in MLP_KINDS)
LM_HEAD = "lm_head"
ALL_KINDS = ATTN_KINDS + MLP_KINDS + EXPERT_KINDS + (LM_HEAD,)
META_KEYS = ("format", "base_fingerprint", "rank", "targets", "dtype", "source")
# safetensors dtype codes <-> torch dtype names used in records and metadata
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
MAX_HEADER = 100 * 1024 * 1024


def module_path(kind: str, layer: int | None) -> str:
    """Blob tensor-name prefix of a target kind in a layer (`lm_head` has no layer)."""
    if kind == LM_HEAD:
        return LM_HEAD
    if kind in ATTN_KINDS:
        return f"layers.{layer}.self_attn.{kind}"
    if kind in MLP_KINDS:
        return f"layers.{layer}.mlp.{kind}"
    if kind in EXPERT_KINDS:
        return f"layers.{layer}.mlp.{kind}"
    raise ValueError(f"unknown target kind {kind!r}; known: {', '.join(ALL_KINDS)}")


def parse_module_path(path: str) -> tuple[str, int | None]:
    """Inverse of `module_path`: `layers.3.mlp.experts.up_proj` -> (`experts.up_proj`, 3)."""
    if path == LM_HEAD:
        return LM_HEAD, None
    parts = path.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[1].isdigit():
        kind = ".".join(parts[3:])
        if parts[2] == "self_attn" and kind in ATTN_KINDS:
            return kind, int(parts[1])
        if parts[2] == "mlp" and (kind in MLP_KINDS or kind in EXPERT_KINDS):
            return kind, int(parts[1])
    raise ValueError(f"not an adapter module path: {path!r}")


def parse_targets(text: str) -> list[str]:
    """`"q_proj,v_proj"` -> `["q_proj", "v_proj"]`, each checked against the known kinds."""
    kinds = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown target kinds {unknown or text!r}; known: {', '.join(ALL_KINDS)}")
    return kinds


def blob_checksum(blob: bytes | memoryview) -> str:
    """xxh3-128 hex digest of a blob (the record's `checksum`)."""
    return xxhash.xxh3_128_hexdigest(blob)


def read_header(blob: bytes | memoryview, what: str = "adapter blob") -> tuple[dict, dict, int]:
    """Parse a safetensors header: (tensor entries, `__metadata__`, data offset). CorruptBlob if bad."""
    if len(blob) < 8:
        raise CorruptBlob(f"{what}: truncated ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if n > MAX_HEADER or 8 + n > len(blob):
        raise CorruptBlob(f"{what}: truncated or bad header length {n}")
    try:
        header = json.loads(bytes(blob[8 : 8 + n]))
    except ValueError as e:
        raise CorruptBlob(f"{what}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptBlob(f"{what}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_len = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + data_len > len(blob):
        raise CorruptBlob(f"{what}: truncated (needs {8 + n + data_len} bytes, has {len(blob)})")
    return header, meta, 8 + n


def read_adapter_meta(blob: bytes | memoryview, what: str = "adapter blob") -> dict:
    """The adapter metadata of a blob, checked: format, base_fingerprint, rank (int), targets (list), dtype, source."""
    _, meta, _ = read_header(blob, what)
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise CorruptBlob(f"{what}: metadata lacks {', '.join(missing)}")
    if meta["format"] != FORMAT:
        raise CorruptBlob(f"{what}: format {meta['format']!r}, expected {FORMAT!r}")
    try:
        rank = int(meta["rank"])
        targets = parse_targets(meta["targets"])
    except ValueError as e:
        raise CorruptBlob(f"{what}: bad metadata ({e})") from None
    return {**meta, "rank": rank, "targets": targets}


def canonical_blob(blob: bytes, dtype_code: str | None = None) -> bytes:
    """Rewrite a safetensors header as sorted compact JSON (optionally forcing every tensor's dtype code).

    safetensors writes `__metadata__` in hash-map order, so two saves of the same tensors may
    differ in bytes; a canonical header makes a blob a pure function of its content (stable
    checksums, idempotent re-imports). Offsets are unchanged; padding keeps the 8-byte alignment.
    """
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    if dtype_code is not None:
        for k, v in header.items():
            if k != "__metadata__":
                v["dtype"] = dtype_code
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * ((-(8 + len(text))) % 8)
    return b"".join((struct.pack("<Q", len(text)), text, memoryview(blob)[8 + n :]))  # one copy of the data
