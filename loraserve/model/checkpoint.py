"""The model's parameter names vs a Hugging Face safetensors checkpoint, for the loader and writer.

Checkpoint files and tensors are read through the catalog's one index
(`loraserve.catalog.checkpoint`). Our parameter names equal transformers' except packed
experts: our `model.layers.{l}.mlp.experts.{proj}.weight` `[E, out, in]` is stored as E tensors
`model.layers.{l}.mlp.experts.{e}.{proj}.weight` `[out, in]`, as transformers writes them.
"""
from __future__ import annotations

from loraserve.catalog.checkpoint import CheckpointError, parse_weight_name, weight_name
from loraserve.catalog.targets import expert_plane_path

__all__ = ["CheckpointError", "expert_tensor_name"]


def expert_tensor_name(param_name: str, expert: int) -> str | None:
    """The per-expert checkpoint name of packed parameter `param_name`'s plane `expert`,
    or None when `param_name` is not a packed expert weight."""
    path = parse_weight_name(param_name)
    try:
        return weight_name(expert_plane_path(path, expert)) if path else None
    except ValueError:  # not a target module, or not an expert one
        return None
