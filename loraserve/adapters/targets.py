"""The base model's LoRA targets as the adapter pool sees them (docs/INTERNALS.md §1).

Target kinds and blob tensor names are the catalog's one table (`loraserve.catalog.targets`,
`tensor_names` re-exported here). The pool keeps one row pool per kind and layer; `TargetSpec`
says which layers have the kind and its sizes. `lm_head` is filed under pseudo-layer 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.catalog.targets import target_kind, tensor_names

__all__ = ["TargetSpec", "TensorSlot", "tensor_index", "tensor_names"]


@dataclass(slots=True)
class TargetSpec:
    """One LoRA target kind of the base: the layers that have it and its input/output sizes.

    Dense kinds map `[*, h_in] -> [*, h_out]`; MoE expert kinds (`experts.*`) have `experts` > 0
    planes of that map. `lm_head` lives in the single pseudo-layer 0 (`layers` empty means [0]).
    """

    kind: str
    layers: list[int]
    h_in: int
    h_out: int
    experts: int = 0
    row_elems: int = field(init=False, default=0)  # elements of one rank row, A + B, per layer

    def __post_init__(self) -> None:
        kind = target_kind(self.kind)
        if kind.is_lm_head:
            self.layers = list(self.layers) or [0]
            if self.layers != [0]:
                raise ValueError("lm_head has no layers: use layers=[0] (or [])")
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"{self.kind}: layers must be distinct non-negative ints, got {self.layers}")
        if self.h_in < 1 or self.h_out < 1:
            raise ValueError(f"{self.kind}: h_in and h_out must be >= 1, got {self.h_in}, {self.h_out}")
        if kind.is_expert and self.experts < 1:
            raise ValueError(f"{self.kind}: MoE expert kinds need experts >= 1")
        if not kind.is_expert and self.experts != 0:
            raise ValueError(f"{self.kind}: only experts.* kinds have experts (got {self.experts})")
        self.layers = sorted(self.layers)
        self.row_elems = (self.h_in + self.h_out) * max(self.experts, 1)

    def a_shape(self, rank: int) -> tuple[int, ...]:
        """Blob shape of `lora_A`: `[r, h_in]`, MoE `[E, r, h_in]`."""
        return (self.experts, rank, self.h_in) if self.experts else (rank, self.h_in)

    def b_shape(self, rank: int) -> tuple[int, ...]:
        """Blob shape of `lora_B`: `[h_out, r]`, MoE `[E, h_out, r]`."""
        return (self.experts, self.h_out, rank) if self.experts else (self.h_out, rank)


@dataclass(slots=True, frozen=True)
class TensorSlot:
    """Where a blob tensor goes in the pool: its kind, layer and whether it is `lora_A`."""

    kind: str
    layer: int
    is_a: bool


def tensor_index(specs: list[TargetSpec]) -> dict[str, TensorSlot]:
    """Every blob tensor name the pool accepts, mapped to its kind / layer / A-or-B."""
    index: dict[str, TensorSlot] = {}
    for spec in specs:
        for layer in spec.layers:
            a_name, b_name = tensor_names(spec.kind, layer)
            index[a_name] = TensorSlot(spec.kind, layer, True)
            index[b_name] = TensorSlot(spec.kind, layer, False)
    return index
