"""The supported architectures and what sets each apart from the shared decoder (torch-free).

Every supported `model_type` runs the one decoder in `transformer.py`. An `Arch` row says which
optional parts that decoder has for the architecture and which config.json features it admits;
`RopeScaling` is the one RoPE frequency scaling admitted (Llama 3.1's `llama3`). Nothing else in
loraserve lists architectures.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

WINDOW_NONE, WINDOW_ALL, WINDOW_UPPER = "none", "all", "upper"
ROPE_SCALING_TYPES = ("llama3",)  # rope types besides "default" that `RopeScaling` implements


class ModelConfigError(ValueError):
    """A config.json that loraserve cannot serve (unknown architecture, unsupported feature...)."""


@dataclass(frozen=True, slots=True)
class Arch:
    """One supported `model_type` and what it changes in the shared decoder.

    window: how a sliding window applies. `all`: every layer masks keys older than
    `sliding_window` whenever that is set (Mistral); `upper`: only when `use_sliding_window`, and
    then in layers `max_window_layers` and up (Qwen2); `none`: never (a window is refused).
    """

    name: str                   # config.json's model_type
    hf_class: str               # transformers' causal-LM class, config.json's "architectures"
    qk_norm: bool = False       # per-head RMSNorm on q and k before RoPE (Qwen3)
    qkv_bias: bool = False      # q/k/v projections always carry a bias (Qwen2)
    bias_options: bool = False  # config's attention_bias (q/k/v/o) and mlp_bias are honoured (Llama)
    moe: bool = False           # routed-experts MLP blocks (Qwen3-MoE)
    rope_types: tuple[str, ...] = ("default",)
    window: str = WINDOW_NONE

    def __post_init__(self) -> None:
        if self.window not in (WINDOW_NONE, WINDOW_ALL, WINDOW_UPPER):
            raise ValueError(f"{self.name}: unknown window rule {self.window!r}")
        if not set(self.rope_types) <= {"default", *ROPE_SCALING_TYPES}:
            raise ValueError(f"{self.name}: unknown rope types {self.rope_types}")


ARCHS = MappingProxyType({a.name: a for a in (
    Arch("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
    Arch("llama", "LlamaForCausalLM", bias_options=True, rope_types=("default", "llama3")),
    Arch("qwen2", "Qwen2ForCausalLM", qkv_bias=True, window=WINDOW_UPPER),
    Arch("mistral", "MistralForCausalLM", window=WINDOW_ALL),
)})


def arch_spec(model_type: object) -> Arch:
    """The row of `model_type`; ModelConfigError (one line, listing the supported ones) otherwise."""
    if model_type not in ARCHS:
        raise ModelConfigError(f"unsupported model_type {model_type!r}; "
                               f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[model_type]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (transformers' `llama3` rope type).

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` keep their
    frequency, those longer than `original_max_position_embeddings / low_freq_factor` are divided
    by `factor`, and the band between is interpolated smoothly.
    """

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ModelConfigError(f"rope_type {self.rope_type!r} is not supported "
                                   f"(supported: default, {', '.join(ROPE_SCALING_TYPES)})")
        if not self.factor >= 1.0:
            raise ModelConfigError(f"rope scaling factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ModelConfigError("rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                   f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ModelConfigError("original_max_position_embeddings must be > 0, "
                                   f"got {self.original_max_position_embeddings}")

    def to_hf_dict(self) -> dict[str, object]:
        """The `rope_scaling` / `rope_parameters` entries transformers reads."""
        return {"rope_type": self.rope_type, "factor": self.factor,
                "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}
