"""Load one targetable base weight from the checkpoint as a torch tensor (the audit's merged reference).

Kept apart from `base` so that reading a base's layout (`BaseInfo`) never imports torch.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from safetensors import safe_open

from .base import BaseInfo
from .checkpoint import read_tensor_index


def _read(info: BaseInfo, names: tuple[str, ...]) -> list[torch.Tensor]:
    index = read_tensor_index(info.model_dir)
    by_file: dict = defaultdict(list)
    for n in names:
        by_file[index[n].file].append(n)
    out = {}
    for path, group in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for n in group:
                out[n] = f.get_tensor(n)
    return [out[n] for n in names]


def load_module_weight(info: BaseInfo, path: str) -> torch.Tensor:
    """W of module `path`: dense [out, in]; experts [E, out, in] (stacked or sliced from fused)."""
    if path not in info.modules:
        raise KeyError(f"{info.model_dir}: base has no module {path!r}")
    m = info.modules[path]
    tensors = _read(info, m.sources)
    if m.experts and len(tensors) > 1:
        return torch.stack(tensors)
    w = tensors[0]
    if m.rows is not None:
        w = w[:, m.rows[0] : m.rows[1], :]
    return w.contiguous()
