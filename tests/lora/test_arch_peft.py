"""PEFT adapters on Llama, Qwen2 and Mistral bases (tests/conftest.py ARCH_BASES: tied head with
llama3 RoPE and MLP biases, q/k/v biases, a sliding window smaller than the prompts): imported
through the exporter, served by the engine, equal to transformers + PEFT alone and in mixed
batches; the catalog's view of each base and the audit."""
from __future__ import annotations

import shutil

import pytest
import torch

from loraserve.audit import run_audit
from loraserve.catalog.base import BaseInfo
from loraserve.catalog.targets import DENSE_KINDS
from loraserve.engine.types import SamplingParams

from lora.conftest import build_set
from lora.test_peft_parity import TOKENS, _check, _engine, _peft_reference

ARCHS = ("llama", "qwen2", "mistral")
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # adapter id -> LoraConfig kwargs
    "t/all7-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL7),
    "t/qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "t/mlp-head-r2": dict(r=2, lora_alpha=4, target_modules=["down_proj", "lm_head"]),
}


@pytest.fixture(scope="module")
def sets(tmp_path_factory, request) -> dict:
    """Per architecture, built on first use: its base with the three adapters in a catalog."""
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            base = request.getfixturevalue(f"hf_{arch}")
            built[arch] = build_set(tmp_path_factory.mktemp(f"{arch}_lora"), base, ADAPTERS)
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_peft(sets, arch):
    aset = sets(arch)
    _check(aset, _engine(aset, "torch"), ["t/all7-r8-rslora", None, "t/qv-r4", "t/mlp-head-r2",
                                          "t/all7-r8-rslora"], seed=11)


@pytest.mark.parametrize("arch", ARCHS)
def test_all_seven_projections_rslora_alone_matches_peft(sets, arch):
    aset = sets(arch)
    _check(aset, _engine(aset, "torch"), ["t/all7-r8-rslora"], seed=12)


def test_triton_backend_mixed_batch_matches_peft(sets):
    aset = sets("qwen2")
    _check(aset, _engine(aset, "triton"), ["t/all7-r8-rslora", "t/qv-r4", None], seed=13)


def test_sliding_window_across_chunked_prefill_and_decode(sets):
    """Mistral's window (6) is far shorter than these prompts: chunks of 7 tokens and every decode
    step mask keys older than the window, and greedy tokens match PEFT."""
    aset = sets("mistral")
    eng = _engine(aset, "torch", max_batched_tokens=7)
    g = torch.Generator().manual_seed(14)
    adapters = ["t/all7-r8-rslora", None, "t/qv-r4"]
    prompts = [torch.randint(3, eng.vocab_size - 3, (n,), generator=g).tolist() for n in (23, 9, 16)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True), adapters)
    for adapter, prompt, out in zip(adapters, prompts, outs):
        assert out == _peft_reference(aset, adapter, prompt)[1], adapter


@pytest.mark.parametrize("arch", ARCHS)
def test_catalog_sees_seven_kinds_and_no_biases(sets, arch):
    base = BaseInfo.from_dir(sets(arch).base)
    assert base.arch == arch and base.num_layers == 2
    kinds = {k: base.paths_for(k) for k in DENSE_KINDS}
    assert all(len(paths) == 2 for paths in kinds.values()), kinds
    assert not any(".bias" in s for m in base.modules.values() for s in m.sources)
    assert base.modules["layers.0.self_attn.k_proj"].out_features == 2 * (12 if arch == "mistral" else 10)
    assert base.modules["lm_head"].sources == (("model.embed_tokens.weight",) if arch == "llama"
                                               else ("lm_head.weight",))


@pytest.mark.parametrize("arch", ARCHS)
def test_audit_passes(sets, arch, tmp_path):
    aset = sets(arch)
    shutil.copytree(aset.catalog, tmp_path / "catalog")  # not the one the engines above had open
    rep = run_audit(tmp_path / "catalog", aset.base, sample=8)
    assert rep.ok and rep.audited == len(ADAPTERS), rep.failures
    assert 0 < rep.max_error < 1e-5


def test_fingerprint_covers_the_window_the_model_applies():
    from loraserve.catalog.base import normalize_config

    mistral = {"model_type": "mistral", "hidden_size": 8, "sliding_window": 6, "max_window_layers": 3}
    assert normalize_config(mistral)["sliding_window"] == 6 and "max_window_layers" not in normalize_config(mistral)
    qwen = {"model_type": "qwen2", "hidden_size": 8, "sliding_window": 6, "max_window_layers": 3}
    assert not {"sliding_window", "max_window_layers"} & set(normalize_config(qwen))  # unused: ignored
    used = normalize_config({**qwen, "use_sliding_window": True})
    assert (used["sliding_window"], used["max_window_layers"]) == (6, 3)
