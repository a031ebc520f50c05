"""The resident base model: config, plain-torch Qwen3 / Qwen3-MoE, checkpoint loader and writer."""
from loraserve.model.checkpoint import CheckpointError
from loraserve.model.config import ModelConfig, ModelConfigError
from loraserve.model.loader import load_model, resolve_dtype
from loraserve.model.qwen3 import AttentionFn, ExpertLinear, Qwen3ForCausalLM, causal_attention
from loraserve.model.writer import save_checkpoint

__all__ = [
    "AttentionFn", "CheckpointError", "ExpertLinear", "ModelConfig", "ModelConfigError",
    "Qwen3ForCausalLM", "causal_attention", "load_model", "resolve_dtype", "save_checkpoint",
]
