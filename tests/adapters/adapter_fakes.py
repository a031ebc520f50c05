"""Small builders shared by the adapter tests: target specs of a tiny base and random adapters."""
from __future__ import annotations

import torch

from loraserve.catalog.layout import AdapterWeights
from loraserve.adapters.targets import TargetSpec, tensor_names

FINGERPRINT = "fp-tiny-base"


def tiny_specs() -> list[TargetSpec]:
    """A tiny mixed base: two attention kinds, one dense MLP kind, one MoE kind, lm_head."""
    return [
        TargetSpec("q_proj", [0, 1], h_in=8, h_out=8),
        TargetSpec("v_proj", [0, 1], h_in=8, h_out=4),
        TargetSpec("down_proj", [0], h_in=12, h_out=8),
        TargetSpec("experts.gate_proj", [1], h_in=8, h_out=6, experts=3),
        TargetSpec("lm_head", [0], h_in=8, h_out=16),
    ]


def make_weights(specs: list[TargetSpec], rank: int, kinds: list[str] | None = None,
                 seed: int = 0, fingerprint: str = FINGERPRINT,
                 dtype: torch.dtype = torch.float32, layers: list[int] | None = None) -> AdapterWeights:
    """A real AdapterWeights with random tensors for `kinds` (default: all) in `layers` (default: all)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in specs:
        if kinds is not None and spec.kind not in kinds:
            continue
        for layer in spec.layers:
            if layers is not None and layer not in layers and spec.kind != "lm_head":
                continue
            a_name, b_name = tensor_names(spec.kind, layer)
            tensors[a_name] = torch.randn(spec.a_shape(rank), generator=gen).to(dtype)
            tensors[b_name] = torch.randn(spec.b_shape(rank), generator=gen).to(dtype)
    targets = sorted({name_kind(n) for n in tensors})
    return AdapterWeights(fingerprint, rank, targets, dtype, tensors)


def name_kind(name: str) -> str:
    """`layers.1.mlp.experts.gate_proj.lora_A` -> `experts.gate_proj`."""
    path = name.rsplit(".", 1)[0]
    return "lm_head" if path == "lm_head" else ".".join(path.split(".")[3:])


def read_back(pool, slot: int) -> dict[str, torch.Tensor]:
    """Rebuild the blob-layout tensors of the adapter in `slot` from the pool's row layout."""
    out = {}
    for kind, spec in pool.specs.items():
        rank = int(pool.ranks[kind][slot])
        if rank == 0:
            continue
        rows = pool.row_table[kind][slot, :rank].long()
        for layer in spec.layers:
            a_name, b_name = tensor_names(kind, layer)
            a = pool.A_rows[kind][layer][rows]  # [r, (E,) in]
            b = pool.B_rows[kind][layer][rows]  # [r, (E,) out]
            out[a_name] = a.transpose(0, 1) if spec.experts else a
            out[b_name] = b.permute(1, 2, 0) if spec.experts else b.t()
    return out
