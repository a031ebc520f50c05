"""LoRA target kinds of the base model and their blob tensor names (docs/INTERNALS.md §1).

A *target kind* is a short module name (`q_proj`, `experts.gate_proj`, `lm_head`, ...). The pool
keeps one row pool per kind and layer; `TargetSpec` says which layers have the kind and its sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ATTN_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_KINDS = ("gate_proj", "up_proj", "down_proj")
EXPERT_KINDS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
LM_HEAD = "lm_head"
ALL_KINDS = ATTN_KINDS + MLP_KINDS + EXPERT_KINDS + (LM_HEAD,)


def tensor_names(kind: str, layer: int) -> tuple[str, str]:
    """Blob tensor names `(lora_A name, lora_B name)` of target `kind` in `layer`.

    `lm_head` has no layer: its names ignore `layer` (the pool files it under pseudo-layer 0).
    """
    if kind in ATTN_KINDS:
        prefix = f"layers.{layer}.self_attn.{kind}"
    elif kind in MLP_KINDS or kind in EXPERT_KINDS:
        prefix = f"layers.{layer}.mlp.{kind}"
    elif kind == LM_HEAD:
        prefix = LM_HEAD
    else:
        raise ValueError(f"unknown LoRA target kind {kind!r}; expected one of {', '.join(ALL_KINDS)}")
    return f"{prefix}.lora_A", f"{prefix}.lora_B"


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
        if self.kind not in ALL_KINDS:
            raise ValueError(f"unknown LoRA target kind {self.kind!r}; expected one of {', '.join(ALL_KINDS)}")
        if self.kind == LM_HEAD:
            self.layers = list(self.layers) or [0]
            if self.layers != [0]:
                raise ValueError("lm_head has no layers: use layers=[0] (or [])")
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"{self.kind}: layers must be distinct non-negative ints, got {self.layers}")
        if self.h_in < 1 or self.h_out < 1:
            raise ValueError(f"{self.kind}: h_in and h_out must be >= 1, got {self.h_in}, {self.h_out}")
        is_moe = self.kind in EXPERT_KINDS
        if is_moe and self.experts < 1:
            raise ValueError(f"{self.kind}: MoE expert kinds need experts >= 1")
        if not is_moe and self.experts != 0:
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
