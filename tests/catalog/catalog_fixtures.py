"""Builders of tiny random bases and PEFT adapters for the catalog tests (never downloaded)."""
from __future__ import annotations

import torch

DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_dense_base(path, seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=48, hidden_size=hidden, intermediate_size=40, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).float()
    model.save_pretrained(path)
    return path


def make_moe_base(path, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(path)
    return path


def randomize_lora(model, seed: int = 1) -> None:
    """PEFT zero-inits lora_B; give every factor random values so deltas are non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_peft(base_dir, out_dir, arch: str, seed: int = 1, **lora_kwargs):
    """Save a PEFT LoRA adapter over the base in `base_dir`; returns (out_dir, peft model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(**lora_kwargs))
    randomize_lora(model, seed)
    model.save_pretrained(out_dir)
    return out_dir, model
