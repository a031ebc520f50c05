"""Names and files of a Hugging Face safetensors checkpoint, shared by the loader and the writer.

Our parameter names equal transformers' except packed experts: our
`model.layers.{l}.mlp.experts.{proj}.weight` `[E, out, in]` is stored as E tensors
`model.layers.{l}.mlp.experts.{e}.{proj}.weight` `[out, in]`, as transformers writes them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint directory whose files or tensors do not match its config."""


def expert_tensor_name(param_name: str, expert: int) -> str | None:
    """The per-expert checkpoint name of packed parameter `param_name`'s plane `expert`,
    or None when `param_name` is not a packed expert weight."""
    m = EXPERT_PARAM.match(param_name)
    if m is None:
        return None
    return f"{m.group(1)}.{expert}.{m.group(2)}.weight"


def shard_file_name(i: int, n: int) -> str:
    """transformers' shard naming, 1-based: model-00001-of-00003.safetensors."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = {name: model_dir / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise CheckpointError(f"shard {file.name} listed in {INDEX_FILE} is missing")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise CheckpointError(f"{model_dir} has only pickle weights (.bin/.pt); loraserve loads "
                              "safetensors only (convert with transformers' save_pretrained)")
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
