"""Adapter weights in serving layout and their safetensors blob (docs/INTERNALS.md §1).

`save_revision` / `load_revision` are the only ways a revision becomes bytes and back;
both check the layout so a blob that loads is one the engine can use as is: every target's
`lora_A`/`lora_B` present, one rank `R` everywhere, scale already folded into B.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import safetensors.torch
import torch

from .errors import CorruptBlob
from .format import EXPERT_KINDS, FORMAT, canonical_blob, parse_module_path, read_adapter_meta

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the name used in records and metadata)."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported serving dtype {dtype}; use one of {', '.join(DTYPES)}")


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; ValueError for anything else."""
    if name not in DTYPES:
        raise ValueError(f"unsupported serving dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _check_pair(path: str, kind: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    ndim = 3 if kind in EXPERT_KINDS else 2
    if a.dim() != ndim or b.dim() != ndim:
        raise ValueError(f"{path}: lora_A/lora_B must be {ndim}-D, got {list(a.shape)} / {list(b.shape)}")
    if a.shape[-2] != rank or b.shape[-1] != rank:
        raise ValueError(f"{path}: rank {a.shape[-2]}/{b.shape[-1]} differs from adapter rank {rank}")
    if ndim == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"{path}: expert counts differ, {a.shape[0]} vs {b.shape[0]}")


def check_layout(weights: AdapterWeights) -> None:
    """Raise ValueError unless `weights` is a complete, consistent serving-layout adapter."""
    modules: dict[str, set[str]] = {}
    for name, t in weights.tensors.items():
        path, _, leaf = name.rpartition(".")
        if leaf not in ("lora_A", "lora_B"):
            raise ValueError(f"{name}: tensor names must end in .lora_A or .lora_B")
        kind, _ = parse_module_path(path)
        if kind not in weights.targets:
            raise ValueError(f"{name}: kind {kind!r} is not among the targets {weights.targets}")
        if t.dtype != weights.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from adapter dtype {weights.dtype}")
        modules.setdefault(path, set()).add(leaf)
    for path, leaves in modules.items():
        if leaves != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: needs both lora_A and lora_B")
        kind, _ = parse_module_path(path)
        t = weights.tensors
        _check_pair(path, kind, t[f"{path}.lora_A"], t[f"{path}.lora_B"], weights.rank)
    seen = {parse_module_path(p)[0] for p in modules}
    if seen != set(weights.targets):
        raise ValueError(f"targets {weights.targets} but tensors cover {sorted(seen)}")


@dataclass(slots=True)
class AdapterWeights:
    """One adapter revision in serving layout (scale folded into B, contiguous, serving dtype)."""

    base_fingerprint: str
    rank: int
    targets: list[str]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [R, in] / [out, R] / [E, R, in] / [E, out, R]
    source: str = ""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        dtype_name(self.dtype)
        check_layout(self)

    @property
    def nbytes(self) -> int:
        """Total tensor bytes (what the adapter costs in memory)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def meta(self) -> dict[str, str]:
        """The blob's `__metadata__` (all strings)."""
        return {
            "format": FORMAT,
            "base_fingerprint": self.base_fingerprint,
            "rank": str(self.rank),
            "targets": ",".join(self.targets),
            "dtype": dtype_name(self.dtype),
            "source": self.source,
        }


def save_revision(weights: AdapterWeights) -> bytes:
    """Serialize to one safetensors blob (tensors made contiguous); equal weights give equal bytes."""
    check_layout(weights)
    tensors = {k: v.contiguous() for k, v in weights.tensors.items()}
    return canonical_blob(safetensors.torch.save(tensors, metadata=weights.meta))


def load_revision(blob: bytes) -> AdapterWeights:
    """Parse a revision blob (safetensors only, never pickle); CorruptBlob if it is malformed."""
    meta = read_adapter_meta(blob)
    try:
        tensors = safetensors.torch.load(bytes(blob))
        return AdapterWeights(
            base_fingerprint=meta["base_fingerprint"],
            rank=meta["rank"],
            targets=meta["targets"],
            dtype=parse_dtype(meta["dtype"]),
            tensors=tensors,
            source=meta["source"],
        )
    except (ValueError, RuntimeError) as e:
        raise CorruptBlob(f"adapter blob: {e}") from None
