"""The model's former single module, kept so `loraserve.model.qwen3` imports keep working.

Qwen3 and Qwen3-MoE now run the shared decoder (`transformer.CausalLM`, parts in `layers`,
`rope` and `moe`); new code imports from `loraserve.model`.
"""
from loraserve.model.layers import MLP, Attention, AttentionFn, RMSNorm, causal_attention
from loraserve.model.moe import Experts, ExpertLinear, SparseMoeBlock
from loraserve.model.rope import RotaryEmbedding, apply_rotary
from loraserve.model.transformer import CausalLM, DecoderLayer

Qwen3ForCausalLM = CausalLM  # the former name of the one causal-LM class

__all__ = ["MLP", "Attention", "AttentionFn", "CausalLM", "DecoderLayer", "ExpertLinear", "Experts",
           "Qwen3ForCausalLM", "RMSNorm", "RotaryEmbedding", "SparseMoeBlock", "apply_rotary",
           "causal_attention"]
