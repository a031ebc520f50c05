"""Adapter weights in serving layout and their safetensors blob (docs/INTERNALS.md §1).

`save_revision` / `load_revision` are the only ways a revision becomes bytes and back;
both check the layout so a blob that loads is one the engine can use as is: every target's
`lora_A`/`lora_B` present, one rank `R` everywhere, scale already folded into B.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import safetensors.torch
import torch

from .dtypes import dtype_name, torch_dtype
from .errors import CorruptBlob
from .format import FORMAT, canonical_blob, read_adapter_meta
from .targets import EXPERT_KINDS, module_path, parse_tensor_name, tensor_names


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
    halves: dict[tuple[str, int | None], set[bool]] = {}  # (kind, layer) -> {is lora_A}
    for name, t in weights.tensors.items():
        kind, layer, is_a = parse_tensor_name(name)
        if kind not in weights.targets:
            raise ValueError(f"{name}: kind {kind!r} is not among the targets {weights.targets}")
        if t.dtype != weights.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from adapter dtype {weights.dtype}")
        halves.setdefault((kind, layer), set()).add(is_a)
    for (kind, layer), seen_a in halves.items():
        path = module_path(kind, layer)
        if seen_a != {True, False}:
            raise ValueError(f"{path}: needs both lora_A and lora_B")
        a_name, b_name = tensor_names(kind, layer)
        _check_pair(path, kind, weights.tensors[a_name], weights.tensors[b_name], weights.rank)
    covered = {kind for kind, _ in halves}
    if covered != set(weights.targets):
        raise ValueError(f"targets {weights.targets} but tensors cover {sorted(covered)}")


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
            dtype=torch_dtype(meta["dtype"]),
            tensors=tensors,
            source=meta["source"],
        )
    except (ValueError, RuntimeError) as e:
        raise CorruptBlob(f"adapter blob: {e}") from None
