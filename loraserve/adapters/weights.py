"""Checking an `AdapterWeights` (catalog.layout, docs/INTERNALS.md §1) against the pool's targets.

The pool reads only these attributes of a weights object: `rank` (int) and `tensors`
(blob tensor name -> tensor); caches read `nbytes` (falling back to the tensors' sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.adapters.targets import TargetSpec, TensorSlot

AdapterKey = tuple[str, str]  # (adapter_id, revision)


@dataclass(slots=True)
class LoadPlan:
    """A validated adapter, ready to copy: its rank, the kinds it targets, its (A, B) per layer."""

    rank: int
    kinds: list[str]
    tensors: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]  # (kind, layer) -> (A, B)


# Host memory a tensor costs beyond its data (Python object, TensorImpl, storage, allocator),
# measured at ~850 B on CPython 3.11 / torch 2.13; charged so that a cache of many small
# adapters stays inside its byte bound in real resident memory, not just in tensor bytes.
TENSOR_OVERHEAD = 1024
ENTRY_OVERHEAD = 1024


def weights_nbytes(weights) -> int:
    """Host bytes an adapter's weights really occupy: tensor data plus per-tensor overhead (a
    slab entry, `slabs.SlabWeights`, keeps no tensor of its own: `tensor_count` 0)."""
    nbytes = getattr(weights, "nbytes", None)
    if not isinstance(nbytes, int):
        nbytes = sum(t.numel() * t.element_size() for t in weights.tensors.values())
    count = getattr(weights, "tensor_count", None)
    count = len(weights.tensors) if count is None else count
    return nbytes + ENTRY_OVERHEAD + TENSOR_OVERHEAD * count


def plan_load(weights, specs: dict[str, TargetSpec], index: dict[str, TensorSlot],
              max_rank: int, rows_per_kind: int) -> LoadPlan:
    """Validate `weights` for a pool with `specs`; ValueError (naming the tensor) if it never fits."""
    rank = int(weights.rank)
    if rank < 1:
        raise ValueError(f"adapter rank must be >= 1, got {rank}")
    limit = min(max_rank, rows_per_kind)
    if rank > limit:
        raise ValueError(f"adapter rank {rank} exceeds the pool's max rank {limit}")
    halves: dict[tuple[str, int], list[torch.Tensor | None]] = {}
    for name, tensor in weights.tensors.items():
        where = index.get(name)
        if where is None:
            raise ValueError(f"tensor {name!r}: the base model has no LoRA target of that name "
                             f"(pool kinds: {', '.join(specs)})")
        spec = specs[where.kind]
        want = spec.a_shape(rank) if where.is_a else spec.b_shape(rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} "
                             f"for rank {rank} on this base")
        if not tensor.is_floating_point():
            raise ValueError(f"tensor {name!r} has non-float dtype {tensor.dtype}")
        halves.setdefault((where.kind, where.layer), [None, None])[0 if where.is_a else 1] = tensor
    if not halves:
        raise ValueError("adapter has no LoRA tensors")
    pairs = {}
    for (kind, layer), (a, b) in halves.items():
        if a is None or b is None:
            missing = "lora_A" if a is None else "lora_B"
            raise ValueError(f"{kind} in layer {layer}: {missing} is missing (A and B come in pairs)")
        pairs[(kind, layer)] = (a, b)
    kinds = sorted({kind for kind, _ in pairs})
    return LoadPlan(rank, kinds, pairs)
