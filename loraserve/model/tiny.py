"""Tiny deterministic bases of any supported architecture (the demo uses Qwen3 and Qwen3-MoE) with
a byte-level tokenizer, for the demo and tests.

The vocabulary is the 256 bytes (token id = byte value) plus `<|endoftext|>`, `<|im_start|>` and
`<|im_end|>`, with a ChatML (Qwen-style) chat template. Weights are drawn from a seeded generator,
so the same seed writes the same bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from loraserve.model.config import ModelConfig
from loraserve.model.transformer import CausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 256, 257, 258
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
# ChatML as Qwen3 writes it, tools included (Hermes-style <tool_call> blocks, tool results as
# <tool_response> in a user turn); without tools a conversation renders as plain ChatML.
CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['content'] is not string %}
{{- raise_exception('message content must be a string') }}
{%- endif %}
{%- if message['role'] == 'system' and tools and loop.first %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|im_start|>assistant\\n' + message['content'] }}
{%- for call in message['tool_calls'] %}
{%- set fn = call['function'] if call['function'] is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' }}
{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def tiny_config(arch: str = "qwen3", **overrides: object) -> ModelConfig:
    """The demo dims: V 259, H 128, 4 layers, 4 heads / 2 kv heads of 32; MoE 8 experts, top-2."""
    base = dict(arch=arch, vocab_size=259, hidden_size=128, intermediate_size=384, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=4096, tie_word_embeddings=False,
                eos_token_ids=[IM_END_ID, ENDOFTEXT_ID], torch_dtype="float32")
    if arch == "qwen3_moe":
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)
    base.update(overrides)
    return ModelConfig(**base)


def random_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A model with weights drawn from a generator seeded with `seed`; norms are 1.

    Matrices are N(0, 1/in_features) so activations keep unit scale, embeddings N(0, 1) and
    lm_head N(0, 4/H) so logits have std ~2: the base babbles with confidence, and a trained
    LoRA's greedy answer wins by a wide margin (robust across implementations and dtypes)."""
    model = CausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name == "model.embed_tokens.weight":
                std = 1.0
            elif name == "lm_head.weight":
                std = 2.0 / config.hidden_size ** 0.5
            else:
                std = 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE without merges: one token per byte (id = byte value), then the specials."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    return tok


def write_tokenizer_files(out_dir: str | Path) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template, eos <|im_end|>), generation_config."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer().save(str(out_dir / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(256 + i): {"content": t, "special": True, "lstrip": False,
                                                "rstrip": False, "normalized": False,
                                                "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }
    gen = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID, "do_sample": False}
    for name, obj in (("tokenizer_config.json", tcfg), ("generation_config.json", gen)):
        (out_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
