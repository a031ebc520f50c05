"""The one index of a Hugging Face safetensors checkpoint directory (torch-free, headers only).

A checkpoint is `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` listed in
`model.safetensors.index.json`. `read_tensor_index` maps every tensor name to its file, dtype
code, shape and byte range, reading only the headers; the catalog (base fingerprint, targetable
modules) and the model loader both read checkpoints through it. A module's weight is stored as
`model.{module path}.weight` (`lm_head.weight` for the head).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .safetensors_header import read_file_header
from .targets import LM_HEAD

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory whose files or tensors are missing, malformed or not safetensors."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one checkpoint tensor lies: file, safetensors dtype code, shape, byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def shard_file_name(i: int, n: int) -> str:
    """transformers' shard naming, 1-based: model-00001-of-00003.safetensors."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def weight_name(path: str) -> str:
    """Checkpoint name of a module's weight: `layers.0.mlp.up_proj` -> `model.layers.0.mlp.up_proj.weight`."""
    return f"{LM_HEAD}.weight" if path == LM_HEAD else f"model.{path}.weight"


def parse_weight_name(name: str) -> str | None:
    """Inverse of `weight_name`: the module path, or None for a tensor that is no module weight."""
    if name == f"{LM_HEAD}.weight":
        return LM_HEAD
    if name.startswith("model.") and name.endswith(".weight"):
        return name.removeprefix("model.").removesuffix(".weight")
    return None


def _indexed_files(model_dir: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from None
    for name in names:
        if not (model_dir / name).is_file():
            raise CheckpointError(f"shard {name} listed in {INDEX_FILE} is missing")
    return [model_dir / n for n in names]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, the single file, or `model-*` shards.

    CheckpointError for a directory with none, naming pickle-only checkpoints as such.
    """
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        return _indexed_files(model_dir, model_dir / INDEX_FILE)
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    shards = sorted(model_dir.glob("model-*.safetensors"))
    if shards:
        return shards
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise CheckpointError(f"{model_dir} has only pickle weights (.bin/.pt); loraserve loads "
                              "safetensors only (convert with transformers' save_pretrained)")
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def file_entries(path: Path) -> dict[str, TensorEntry]:
    """The tensor entries of one safetensors file (header only, no tensor bytes)."""
    entries, _, base = read_file_header(path, CheckpointError)
    return {
        name: TensorEntry(path, e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0], base + e["data_offsets"][1])
        for name, e in entries.items()
    }


def read_tensor_index(model_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint by name, from the files' headers."""
    index: dict[str, TensorEntry] = {}
    for path in checkpoint_files(model_dir):
        index.update(file_entries(path))
    return index
