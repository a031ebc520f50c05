"""Architecture config of the resident base model, read from a Hugging Face `config.json`.

`ModelConfig` is the one place that knows the Hugging Face spellings (transformers 4 and 5 differ:
`num_experts` vs `num_local_experts`, `rope_theta` and `rope_scaling` vs `rope_parameters`,
`torch_dtype` vs `dtype`); everything else in loraserve reads the normalised fields. What sets the
supported architectures apart is the table in `arch.py`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraserve.catalog.dtypes import SERVING_DTYPES
from loraserve.model.arch import (ARCHS, WINDOW_ALL, WINDOW_NONE, WINDOW_UPPER, Arch, ModelConfigError,
                                  RopeScaling, arch_spec)

__all__ = ["ModelConfig", "ModelConfigError", "RopeScaling"]


@dataclass(slots=True)
class ModelConfig:
    """Normalised decoder architecture. Letters: H hidden, V vocab, E experts, L layers."""

    arch: str                      # a model_type of `arch.ARCHS`
    vocab_size: int                # V
    hidden_size: int               # H
    intermediate_size: int         # dense MLP width (also MoE models' mlp_only layers)
    num_layers: int                # L
    num_heads: int                 # query heads
    num_kv_heads: int              # key/value heads (GQA); divides num_heads
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # bias on q/k/v/o (Llama's option; Qwen2's q/k/v bias is its Arch's)
    mlp_bias: bool = False         # bias on gate/up/down (Llama's option)
    sliding_window: int | None = None  # window layers see only the last W positions (incl. their own)
    max_window_layers: int = 0     # window layers are those >= this (Qwen2); 0: all (Mistral)
    num_experts: int = 0           # E (0 for dense)
    num_experts_per_tok: int = 0   # top-k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype name, e.g. "bfloat16"

    def __post_init__(self) -> None:
        arch_spec(self.arch)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                     "decoder_sparse_step"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads ({self.num_heads}) must be a multiple of "
                                   f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelConfigError("rms_norm_eps and rope_theta must be > 0")
        if self.torch_dtype is not None and self.torch_dtype not in SERVING_DTYPES:
            raise ModelConfigError(f"unsupported dtype {self.torch_dtype!r}; expected {SERVING_DTYPES}")
        if any(not 0 <= l < self.num_layers for l in self.mlp_only_layers):
            raise ModelConfigError(f"mlp_only_layers {self.mlp_only_layers} out of range")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ModelConfigError(f"eos_token_ids {self.eos_token_ids} out of vocab range")
        self._check_arch_features()
        self._check_moe()

    def _check_arch_features(self) -> None:
        """Biases, RoPE scaling and sliding windows only where the architecture has them."""
        spec = self.spec
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name) and not spec.bias_options:
                raise ModelConfigError(f"{name}=true is not supported for {self.arch} "
                                       "(its checkpoints have no such bias)")
        rope_type = self.rope_scaling.rope_type if self.rope_scaling else "default"
        if rope_type not in spec.rope_types:
            raise ModelConfigError(f"rope_type {rope_type!r} is not supported for {self.arch} "
                                   f"(supported: {', '.join(spec.rope_types)})")
        if self.sliding_window is not None:
            if spec.window == WINDOW_NONE:
                raise ModelConfigError(f"use_sliding_window / sliding_window is not supported for {self.arch}")
            if self.sliding_window <= 0 or self.max_window_layers < 0:
                raise ModelConfigError(f"sliding_window must be > 0 and max_window_layers >= 0, got "
                                       f"{self.sliding_window} and {self.max_window_layers}")

    def _check_moe(self) -> None:
        if not self.spec.moe:
            if self.num_experts:
                raise ModelConfigError(f"a dense {self.arch} config cannot have num_experts > 0")
            return
        if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ModelConfigError(f"{self.arch} needs num_experts > 0 and moe_intermediate_size > 0")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be in [1, {self.num_experts}], "
                                   f"got {self.num_experts_per_tok}")

    @property
    def spec(self) -> Arch:
        """The architecture's row in `arch.ARCHS`."""
        return ARCHS[self.arch]

    @property
    def is_moe(self) -> bool:
        return self.spec.moe

    @property
    def qk_norm(self) -> bool:
        return self.spec.qk_norm

    @property
    def qkv_bias(self) -> bool:
        return self.spec.qkv_bias or self.attention_bias

    def is_moe_layer(self, l: int) -> bool:
        """Whether decoder layer `l` uses the routed-experts block (transformers' rule)."""
        return (self.num_experts > 0 and l not in self.mlp_only_layers
                and (l + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, l: int) -> int | None:
        """Layer `l`'s sliding window W (a query at position p sees keys p-W+1..p), or None when
        the layer attends to the whole causal context (also when W covers every position)."""
        w = self.sliding_window
        if w is None or l < self.max_window_layers or w >= self.max_position_embeddings:
            return None
        return w

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json`."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"{file} not found: not a Hugging Face model directory")
        try:
            d = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face config dict; unsupported features raise ModelConfigError."""
        spec = arch_spec(d.get("model_type"))
        if d.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        try:
            return cls(arch=spec.name, **_common_fields(d), **_rope_fields(d, spec), **_window_fields(d, spec),
                       **_moe_fields(d, spec))
        except KeyError as e:
            raise ModelConfigError(f"config.json is missing {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers writes for this architecture (4.x and 5.x both read it)."""
        spec = self.spec
        d: dict[str, Any] = {
            "architectures": [spec.hf_class], "model_type": self.arch,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "attention_dropout": 0.0, "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "eos_token_id": list(self.eos_token_ids) or None, "bos_token_id": None,
            "pad_token_id": None, "use_cache": True,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
            d["rope_parameters"] = {"rope_theta": self.rope_theta, **d["rope_scaling"]}
        if spec.bias_options:
            d["mlp_bias"] = self.mlp_bias
        if spec.window == WINDOW_UPPER:
            d["max_window_layers"] = self.max_window_layers
        if self.torch_dtype is not None:
            d["torch_dtype"] = d["dtype"] = self.torch_dtype
        if spec.moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers), router_aux_loss_coef=0.001,
                     output_router_logits=False)
        return d


def _common_fields(d: dict[str, Any]) -> dict[str, Any]:
    heads = int(d["num_attention_heads"])
    eos = d.get("eos_token_id")
    return dict(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
        eos_token_ids=[] if eos is None else [int(t) for t in ([eos] if isinstance(eos, int) else eos)],
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def _rope_fields(d: dict[str, Any], spec: Arch) -> dict[str, Any]:
    """rope_theta and scaling from `rope_scaling` (published configs) or `rope_parameters`
    (transformers 5), the latter winning where both name a key."""
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in spec.rope_types:
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported for {spec.name} "
                               f"(supported: {', '.join(spec.rope_types)})")
    if rope_type == "default":
        return dict(rope_theta=theta)
    # like transformers, the pretraining context defaults to max_position_embeddings
    original = rope.get("original_max_position_embeddings") or d.get("max_position_embeddings")
    return dict(rope_theta=theta, rope_scaling=RopeScaling(
        rope_type, float(rope["factor"]), float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]), int(original)))


def _window_fields(d: dict[str, Any], spec: Arch) -> dict[str, Any]:
    """sliding_window / max_window_layers as transformers applies them (its defaults included)."""
    if spec.window == WINDOW_ALL:
        window = d.get("sliding_window", 4096)
        return dict(sliding_window=None if window is None else int(window))
    if not d.get("use_sliding_window", False) or d.get("sliding_window", 4096) is None:
        return {}
    first = int(d.get("max_window_layers", 28))
    types = d.get("layer_types")
    if types is not None:  # transformers 5 writes the per-layer rule out; it must be ours
        layers = int(d["num_hidden_layers"])
        sliding = [t == "sliding_attention" for t in types]
        first = sliding.index(True) if any(sliding) else layers
        if len(types) != layers or not all(sliding[first:]):
            raise ModelConfigError(f"layer_types {types} is not supported: sliding-window layers "
                                   "must be the last ones")
    return dict(sliding_window=int(d.get("sliding_window", 4096)), max_window_layers=first)


def _moe_fields(d: dict[str, Any], spec: Arch) -> dict[str, Any]:
    if not spec.moe:
        return {}
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return dict(
        num_experts=int(experts), num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=[int(l) for l in d.get("mlp_only_layers") or []],
    )
