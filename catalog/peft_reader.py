"""Read a PEFT LoRA adapter directory: its config (ranks, alphas, rsLoRA) and LoRA tensors.

Only `adapter_model.safetensors` is read (never the pickle `adapter_model.bin`). Tensor keys
are normalized from `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` to
module `model.layers.0.self_attn.q_proj`, factor `A`. Anything that is not a plain LoRA
factor (embedding LoRA, DoRA magnitudes, LoRA biases, modules_to_save copies) is refused
with an ExportError naming the tensor.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import ExportError

_KEY = re.compile(r"^(?P<module>.+?)\.lora_(?P<factor>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_UNSUPPORTED_FLAGS = ("use_dora", "fan_in_fan_out", "lora_bias", "use_qalora")


@dataclass(slots=True)
class PeftLoraConfig:
    """The parts of `adapter_config.json` that decide each module's rank and scale."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ExportError(f"adapter_config.json: r must be >= 1, got {self.r}")

    @classmethod
    def from_dir(cls, peft_dir: Path) -> PeftLoraConfig:
        path = peft_dir / "adapter_config.json"
        if not path.exists():
            raise ExportError(f"{peft_dir}: no adapter_config.json (not a PEFT adapter directory)")
        cfg = json.loads(path.read_text())
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ExportError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
        for flag in _UNSUPPORTED_FLAGS:
            if cfg.get(flag):
                raise ExportError(f"{path}: {flag}=true is not supported by the serving layout")
        return cls(
            r=int(cfg["r"]),
            lora_alpha=float(cfg.get("lora_alpha", cfg["r"])),
            use_rslora=bool(cfg.get("use_rslora", False)),
            rank_pattern={k: int(v) for k, v in (cfg.get("rank_pattern") or {}).items()},
            alpha_pattern={k: float(v) for k, v in (cfg.get("alpha_pattern") or {}).items()},
        )

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """PEFT's (r, scaling) for a module name: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        r = _pattern_value(self.rank_pattern, module, self.r)
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return int(r), alpha / (math.sqrt(r) if self.use_rslora else r)


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's pattern lookup: a key matches a module name that ends in `.key` (or is `key`)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft_tensors(peft_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors from `adapter_model.safetensors`; ExportError for pickle-only dirs."""
    path = peft_dir / "adapter_model.safetensors"
    if not path.exists():
        if (peft_dir / "adapter_model.bin").exists():
            raise ExportError(f"{peft_dir}: only adapter_model.bin (pickle) found; save with safe_serialization=True")
        raise ExportError(f"{peft_dir}: no adapter_model.safetensors")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for truncated files
        raise ExportError(f"{path}: cannot read safetensors ({e})") from None


def split_base_copies(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(LoRA tensors, base-weight copies). PEFT saves `lm_head.base_layer.weight` (embedding layers)
    beside the LoRA factors when lm_head/embeddings are targeted; those are base weights, not LoRA."""
    copies = {k: v for k, v in tensors.items() if k.endswith(".base_layer.weight")}
    return {k: v for k, v in tensors.items() if k not in copies}, copies


def group_factors(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, tuple[str, torch.Tensor]]]:
    """`{module: {"A": (tensor name, A), "B": (tensor name, B)}}`, module without `base_model.model.`."""
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if not m:
            raise ExportError(f"{name}: not a LoRA A/B factor (unsupported PEFT tensor)")
        module = m["module"].removeprefix("base_model.model.")
        groups.setdefault(module, {})[m["factor"]] = (name, t)
    for module, factors in groups.items():
        if set(factors) != {"A", "B"}:
            missing = "lora_B" if "A" in factors else "lora_A"
            raise ExportError(f"{module}: has no {missing} tensor")
    return groups
