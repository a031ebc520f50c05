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
from safetensors.torch import load as load_safetensors

from .errors import ExportError
from .source import AdapterSource

_KEY = re.compile(r"^(?P<module>.+?)\.lora_(?P<factor>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_UNSUPPORTED_FLAGS = ("use_dora", "fan_in_fan_out", "lora_bias", "use_qalora")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 1 << 20
# rank/alpha pattern keys are regexes (PEFT's rule); a bounded, group-free subset keeps matching
# them linear-time, so no key can stall an import thread
_PATTERN = re.compile(r"[A-Za-z0-9_.\-^$|\\\[\]]*(?:[*+?][A-Za-z0-9_.\-^$|\\\[\]]*){0,2}")
PATTERN_MAX = 256


def as_source(peft_dir: str | Path | AdapterSource) -> AdapterSource:
    """`peft_dir` as an AdapterSource (a plain path is read unconfined, unbounded: the command line)."""
    return peft_dir if isinstance(peft_dir, AdapterSource) else AdapterSource(peft_dir)


class _Fields:
    """Typed reads of `adapter_config.json` fields; ExportError (400) naming the field."""

    def __init__(self, cfg: dict, where: str) -> None:
        self.cfg, self.where = cfg, where

    def fail(self, name: str, want: str) -> ExportError:
        got = self.cfg.get(name)
        return ExportError(f"{self.where}: field {name!r} must be {want}, got {json.dumps(got)[:80]}")

    def rank(self, name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(name, "an integer >= 1")
        return value

    def number(self, name: str, value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(name, "a finite number")
        return float(value)

    def flag(self, name: str) -> bool:
        value = self.cfg.get(name)
        if value is not None and not isinstance(value, bool):
            raise self.fail(name, "true or false")
        return bool(value)

    def patterns(self, name: str, convert) -> dict:
        value = self.cfg.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(name, "an object of module pattern -> value")
        for key in value:
            if len(key) > PATTERN_MAX or not _PATTERN.fullmatch(key) or not _compiles(key):
                raise ExportError(f"{self.where}: field {name!r}: key {key[:80]!r} is not a supported "
                                  "module pattern (module names, '.', '^', '$', '|', classes, at most 2 of '*+?')")
        return {k: convert(f"{name}.{k}", v) for k, v in value.items()}


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _parse_json(raw: bytes, where: str) -> dict:
    try:
        cfg = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ExportError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ExportError(f"{where}: JSON nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{where}: must be a JSON object")
    return cfg


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
        if not math.isfinite(self.lora_alpha):
            raise ExportError(f"adapter_config.json: lora_alpha must be finite, got {self.lora_alpha}")

    @classmethod
    def from_dir(cls, peft_dir: str | Path | AdapterSource) -> PeftLoraConfig:
        source = as_source(peft_dir)
        try:
            raw = source.read(CONFIG, limit=CONFIG_MAX_BYTES)
        except FileNotFoundError:
            raise ExportError(f"{source.shown}: no {CONFIG} (not a PEFT adapter directory)") from None
        return cls.from_json(raw, source.describe(CONFIG))

    @classmethod
    def from_json(cls, raw: bytes, where: str = CONFIG) -> PeftLoraConfig:
        """Parse and check the config; ExportError (400) naming the file and the field."""
        cfg = _parse_json(raw, where)
        fields = _Fields(cfg, where)
        peft_type = cfg.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ExportError(f"{where}: peft_type {peft_type!r} is not LORA")
        for flag in _UNSUPPORTED_FLAGS:
            if cfg.get(flag):
                raise ExportError(f"{where}: {flag}=true is not supported by the serving layout")
        if "r" not in cfg:
            raise ExportError(f"{where}: field 'r' (the LoRA rank) is missing")
        r = fields.rank("r", cfg["r"])
        alpha = cfg.get("lora_alpha")
        return cls(
            r=r,
            lora_alpha=float(r) if alpha is None else fields.number("lora_alpha", alpha),
            use_rslora=fields.flag("use_rslora"),
            rank_pattern=fields.patterns("rank_pattern", fields.rank),
            alpha_pattern=fields.patterns("alpha_pattern", fields.number),
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


def read_peft_tensors(peft_dir: str | Path | AdapterSource) -> dict[str, torch.Tensor]:
    """The adapter's tensors from `adapter_model.safetensors`; ExportError for pickle-only dirs."""
    source = as_source(peft_dir)
    try:
        raw = source.read(WEIGHTS)
    except FileNotFoundError:
        if source.exists("adapter_model.bin"):
            raise ExportError(f"{source.shown}: only adapter_model.bin (pickle) found; save with safe_serialization=True") from None
        raise ExportError(f"{source.shown}: no {WEIGHTS}") from None
    try:
        return load_safetensors(raw)
    except Exception as e:  # safetensors raises its own error type for truncated files
        raise ExportError(f"{source.describe(WEIGHTS)}: cannot read safetensors ({e})") from None


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
