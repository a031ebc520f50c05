"""The adapter blob format, torch-free: metadata, header, checksum (kinds and names: catalog.targets).

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

import xxhash

from . import safetensors_header
from .errors import CorruptBlob
from .safetensors_header import PREFIX, header_json, header_length
from .targets import ALL_KINDS, EXPERT_KINDS, LM_HEAD, module_path, parse_module_path, parse_targets

__all__ = [  # the target names are the table's (catalog.targets), re-exported for blob users
    "ALL_KINDS", "EXPERT_KINDS", "FORMAT", "LM_HEAD", "META_KEYS", "blob_checksum", "canonical_blob",
    "check_adapter_meta", "module_path", "parse_module_path", "parse_targets", "read_adapter_meta",
    "read_header",
]

FORMAT = "loraserve.adapter.v1"
META_KEYS = ("format", "base_fingerprint", "rank", "targets", "dtype", "source")


def blob_checksum(blob: bytes | memoryview) -> str:
    """xxh3-128 hex digest of a blob (the record's `checksum`)."""
    return xxhash.xxh3_128_hexdigest(blob)


def read_header(blob: bytes | memoryview, what: str = "adapter blob") -> tuple[dict, dict, int]:
    """Parse a safetensors header: (tensor entries, `__metadata__`, data offset). CorruptBlob if bad."""
    return safetensors_header.read_header(blob, what, CorruptBlob)


def read_adapter_meta(blob: bytes | memoryview, what: str = "adapter blob") -> dict:
    """The adapter metadata of a blob, checked: format, base_fingerprint, rank (int), targets (list), dtype, source."""
    _, meta, _ = read_header(blob, what)
    return check_adapter_meta(meta, what)


def check_adapter_meta(meta: dict, what: str = "adapter blob") -> dict:
    """`meta` (a blob's `__metadata__`) checked and typed as `read_adapter_meta` returns it."""
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
    n = header_length(blob[: PREFIX.size], len(blob), "adapter blob", CorruptBlob)
    header = header_json(blob[PREFIX.size : PREFIX.size + n], "adapter blob", CorruptBlob)
    if dtype_code is not None:
        for k, v in header.items():
            if k != "__metadata__":
                v["dtype"] = dtype_code
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * ((-(PREFIX.size + len(text))) % 8)
    return b"".join((PREFIX.pack(len(text)), text, memoryview(blob)[PREFIX.size + n :]))  # one copy of the data
