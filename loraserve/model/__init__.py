"""The resident base model: config, the plain-torch decoder of every supported architecture
(Qwen3, Qwen3-MoE, Llama, Qwen2, Mistral), checkpoint loader and writer."""
from loraserve.model.arch import ARCHS, ModelConfigError
from loraserve.model.checkpoint import CheckpointError
from loraserve.model.config import ModelConfig
from loraserve.model.layers import AttentionFn, causal_attention
from loraserve.model.loader import load_model, resolve_dtype
from loraserve.model.moe import ExpertLinear
from loraserve.model.transformer import CausalLM
from loraserve.model.writer import save_checkpoint

__all__ = [
    "ARCHS", "AttentionFn", "CausalLM", "CheckpointError", "ExpertLinear", "ModelConfig",
    "ModelConfigError", "causal_attention", "load_model", "resolve_dtype",
    "save_checkpoint",
]
