"""Architecture config of the resident base model, read from a Hugging Face `config.json`.

`ModelConfig` is the one place that knows the Hugging Face spellings (transformers 4 and 5 differ:
`num_experts` vs `num_local_experts`, `rope_theta` vs `rope_parameters.rope_theta`, `torch_dtype`
vs `dtype`); everything else in loraserve reads the normalised fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraserve.catalog.dtypes import SERVING_DTYPES

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class ModelConfigError(ValueError):
    """A config.json that loraserve cannot serve (unknown architecture, unsupported feature...)."""


@dataclass(slots=True)
class ModelConfig:
    """Normalised Qwen3 / Qwen3-MoE architecture. Letters: H hidden, V vocab, E experts, L layers."""

    arch: str                      # "qwen3" | "qwen3_moe"
    vocab_size: int                # V
    hidden_size: int               # H
    intermediate_size: int         # dense MLP width (also MoE models' mlp_only layers)
    num_layers: int                # L
    num_heads: int                 # query heads
    num_kv_heads: int              # key/value heads (GQA); divides num_heads
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    num_experts: int = 0           # E (0 for dense)
    num_experts_per_tok: int = 0   # top-k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype name, e.g. "bfloat16"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelConfigError(f"unsupported model_type {self.arch!r}; "
                                   f"expected one of {sorted(ARCHITECTURES)}")
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
        self._check_moe()

    def _check_moe(self) -> None:
        if self.arch == "qwen3":
            if self.num_experts:
                raise ModelConfigError("a dense qwen3 config cannot have num_experts > 0")
            return
        if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ModelConfigError("qwen3_moe needs num_experts > 0 and moe_intermediate_size > 0")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be in [1, {self.num_experts}], "
                                   f"got {self.num_experts_per_tok}")

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen3_moe"

    def is_moe_layer(self, l: int) -> bool:
        """Whether decoder layer `l` uses the routed-experts block (transformers' rule)."""
        return (self.num_experts > 0 and l not in self.mlp_only_layers
                and (l + 1) % self.decoder_sparse_step == 0)

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
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            raise ModelConfigError(f"unsupported model_type {arch!r}; "
                                   f"expected one of {sorted(ARCHITECTURES)}")
        _reject_unsupported(d)
        try:
            return cls(arch=arch, **_common_fields(d), **_moe_fields(d, arch))
        except KeyError as e:
            raise ModelConfigError(f"config.json is missing {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers writes for this architecture (4.x and 5.x both read it)."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False,
            "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
            "eos_token_id": list(self.eos_token_ids) or None, "bos_token_id": None,
            "pad_token_id": None, "use_cache": True,
        }
        if self.torch_dtype is not None:
            d["torch_dtype"] = d["dtype"] = self.torch_dtype
        if self.arch == "qwen3_moe":
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers), router_aux_loss_coef=0.001,
                     output_router_logits=False)
        return d


def _reject_unsupported(d: dict[str, Any]) -> None:
    if d.get("attention_bias", False):
        raise ModelConfigError("attention_bias=true is not supported (Qwen3 has no attention bias)")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
    if d.get("use_sliding_window", False):
        raise ModelConfigError("use_sliding_window=true is not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported (only default RoPE)")


def _common_fields(d: dict[str, Any]) -> dict[str, Any]:
    heads = int(d["num_attention_heads"])
    rope = d.get("rope_parameters") or {}
    eos = d.get("eos_token_id")
    return dict(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        eos_token_ids=[] if eos is None else [int(t) for t in ([eos] if isinstance(eos, int) else eos)],
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def _moe_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch != "qwen3_moe":
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
