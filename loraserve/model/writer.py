"""Write a `CausalLM` as a Hugging Face checkpoint directory transformers can load.

Layout: `config.json`, then `model.safetensors` or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json`; packed experts are written per expert, tied lm_head is omitted.
Output bytes depend only on the weights and config (sorted JSON, fixed tensor order).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from loraserve.catalog.checkpoint import INDEX_FILE, SINGLE_FILE, shard_file_name
from loraserve.catalog.dtypes import dtype_name
from loraserve.model.checkpoint import expert_tensor_name
from loraserve.model.transformer import CausalLM


def checkpoint_tensors(model: CausalLM) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, contiguous CPU tensor) for every weight, in parameter order."""
    for name, param in model.named_parameters():   # a tied lm_head is deduplicated away
        t = param.detach()
        if expert_tensor_name(name, 0) is None:
            yield name, t.contiguous().cpu()
            continue
        for e in range(t.shape[0]):
            yield expert_tensor_name(name, e), t[e].clone().cpu()


def _shards(tensors: list[tuple[str, Tensor]], max_bytes: int | None) -> list[list[tuple[str, Tensor]]]:
    """Greedy split in order; a tensor larger than max_bytes gets a shard of its own."""
    shards: list[list[tuple[str, Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def save_checkpoint(model: CausalLM, out_dir: str | Path, *,
                    max_shard_bytes: int | None = None) -> None:
    """Write `model` (weights in their current dtype) to `out_dir` in Hugging Face layout."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype_name(next(model.parameters()).dtype)  # ValueError unless a serving dtype
    tensors = list(checkpoint_tensors(model))
    shards = _shards(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(dict(shards[0]), out_dir / SINGLE_FILE, metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = shard_file_name(i, len(shards))
            save_file(dict(shard), out_dir / file, metadata=meta)
            weight_map.update({name: file for name, _ in shard})
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out_dir / INDEX_FILE, index)
    config = model.config.to_hf_dict()
    config["torch_dtype"] = config["dtype"] = dtype
    _write_json(out_dir / "config.json", config)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
