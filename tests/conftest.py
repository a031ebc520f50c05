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

# transformers, on this thread before any test starts an engine: an engine's grammar worker
# imports xgrammar, which imports transformers, and a `from transformers import X` on another
# thread meanwhile gets the half-built module that transformers' package swaps out of
# sys.modules as its import ends ("cannot import name 'Qwen3Config'", under xdist, now and then)
import transformers  # noqa: E402,F401

from loraserve.demo import build_demo_base
from run_guards import encodable_report, root_logger_restored

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(autouse=True)
def _logging_left_as_found():
    """Every test gets the root logger back as it found it (run_guards)."""
    with root_logger_restored():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Reports xdist can send, whatever a test captured (run_guards)."""
    outcome = yield
    encodable_report(outcome.get_result())


def pytest_collection_modifyitems(config, items):
    """`ray` tests start a local Ray cluster on every core: an xdist worker (running beside the
    other tests) leaves them out, reported as deselected; `make test` runs them alone after the
    rest (`-m ray`)."""
    if not hasattr(config, "workerinput"):
        return
    ray = [item for item in items if item.get_closest_marker("ray")]
    if ray:
        config.hook.pytest_deselected(items=ray)
        items[:] = [item for item in items if not item.get_closest_marker("ray")]


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


ARCH_BASES = {  # model_type -> (transformers config class, causal-LM class, config): odd sizes, GQA
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(  # Llama 3.2-like: tied, llama3 RoPE
        tie_word_embeddings=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),  # q/k/v biases
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=12, sliding_window=6)),
}


def _hf_arch_base(root: Path, demo: Path, arch: str) -> Path:
    """A tiny `arch` base (see ARCH_BASES) with unit-scale random weights and biases, so logits
    are confident, and the demo tokenizer."""
    import transformers

    torch.manual_seed(2)
    demo_cfg = json.loads((demo / "config.json").read_text())
    config_cls, model_cls, extra = ARCH_BASES[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=demo_cfg["vocab_size"], hidden_size=60, intermediate_size=92, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=demo_cfg["eos_token_id"], **extra)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    out = root / arch
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(demo / name, out / name)
    return out


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory, demo_dense) -> Path:
    return _hf_arch_base(tmp_path_factory.mktemp("hf_llama"), demo_dense, "llama")


@pytest.fixture(scope="session")
def hf_qwen2(tmp_path_factory, demo_dense) -> Path:
    return _hf_arch_base(tmp_path_factory.mktemp("hf_qwen2"), demo_dense, "qwen2")


@pytest.fixture(scope="session")
def hf_mistral(tmp_path_factory, demo_dense) -> Path:
    return _hf_arch_base(tmp_path_factory.mktemp("hf_mistral"), demo_dense, "mistral")


@pytest.fixture()
def serve_config(monkeypatch):
    """serve_config(argv): the EngineConfig `loraserve serve ARGV --single-process` builds
    (nothing started)."""
    from loraserve.cli import main
    from loraserve.engine import async_engine
    from loraserve.server import app

    seen = {}
    monkeypatch.setattr(async_engine.AsyncEngine, "from_config",
                        classmethod(lambda cls, cfg: seen.setdefault("cfg", cfg)))
    monkeypatch.setattr(app, "run_server", lambda *a, **k: None)

    def build(argv: list[str]):
        assert main(["serve", *argv, "--single-process"]) == 0
        return seen.pop("cfg")
    return build
