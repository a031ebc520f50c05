"""Hand-written PEFT adapter directories and catalog-file surgery for the fault tests.

`write_peft` writes what PEFT's save_pretrained writes for a LoRA on q_proj/v_proj (its
`adapter_config.json` and `adapter_model.safetensors`), with shapes taken from the base, so a
test can make any rank, value (NaN, Inf) or config without running PEFT.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.catalog.base import BaseInfo


def peft_key(path: str, factor: str) -> str:
    """PEFT's tensor name of module `path` (blob layout, e.g. `layers.0.self_attn.q_proj`)."""
    prefix = "base_model.model." if path == "lm_head" else "base_model.model.model."
    return f"{prefix}{path}.lora_{factor}.weight"


def write_peft(out: Path, base_dir: Path, r: int = 4, alpha: float = 8.0, targets=("q_proj", "v_proj"),
               seed: int = 0, config: dict | None = None) -> Path:
    """A PEFT LoRA directory for the base in `base_dir`; `config` replaces adapter_config.json."""
    base = BaseInfo.from_dir(base_dir, fingerprint="unused")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for kind in targets:
        for path in base.paths_for(kind):
            m = base.modules[path]
            tensors[peft_key(path, "A")] = torch.randn(r, m.in_features, generator=g) * 0.2
            tensors[peft_key(path, "B")] = torch.randn(m.out_features, r, generator=g) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = config if config is not None else {"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                             "target_modules": list(targets)}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def poison(peft_dir: Path, value: float, key_part: str = "v_proj.lora_B") -> str:
    """Put `value` (NaN, Inf) into the first tensor whose name contains `key_part`; its name."""
    from safetensors.torch import load_file

    path = peft_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if key_part in k)[0]
    tensors[name][0, 0] = value
    save_file(tensors, str(path))
    return name


def fill(peft_dir: Path, value: float, key_parts=("k_proj.", "v_proj.")) -> list[str]:
    """Fill every tensor whose name contains one of `key_parts` with `value` (finite but huge
    factors: the issue's 1e19 and float16-max adapters); their names."""
    from safetensors.torch import load_file

    path = peft_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    names = sorted(k for k in tensors if any(p in k for p in key_parts))
    for name in names:
        tensors[name].fill_(value)
    save_file(tensors, str(path))
    return names


def truncate(path: Path, size: int) -> bytes:
    """Cut the file at `path` to `size` bytes in place (same inode); its old content."""
    content = path.read_bytes()
    os.truncate(path, size)
    return content


def restore(path: Path, content: bytes) -> None:
    """Write `content` back into the same inode (what `truncate` took away)."""
    with open(path, "r+b") as f:
        f.write(content)
