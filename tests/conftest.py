"""Shared fixtures. Tiny bases written by transformers' save_pretrained (the outside reference),
with the demo tokenizer copied in so the engine can tokenize.

Without CUDA, Triton kernels run in the interpreter; the flag must be set before anything imports
`kernels`, hence here, in the root conftest."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraserve.demo import build_demo_base

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls run several times faster on one thread than on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_dense(tmp_path_factory) -> Path:
    return build_demo_base(tmp_path_factory.mktemp("demo") / "qwen3", arch="qwen3", seed=0)


def _hf_base(root: Path, demo: Path, arch: str) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  eos_token_id=json.loads((demo / "config.json").read_text())["eos_token_id"])
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, tie_word_embeddings=False, **common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common))
    model = model.eval()
    out = root / arch
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(demo / name, out / name)
    return out


@pytest.fixture(scope="session")
def hf_dense(tmp_path_factory, demo_dense) -> Path:
    return _hf_base(tmp_path_factory.mktemp("hf"), demo_dense, "qwen3")


@pytest.fixture(scope="session")
def hf_moe(tmp_path_factory, demo_dense) -> Path:
    return _hf_base(tmp_path_factory.mktemp("hfmoe"), demo_dense, "qwen3_moe")
