"""The demo: deterministic bases transformers can load, adapters PEFT reproduces, a demo catalog."""
from __future__ import annotations

import fcntl
import os

import pytest
import torch

from loraserve.demo import DEMO_ADAPTERS, build_demo, build_demo_base, main
from loraserve.model import load_model
from loraserve.model.generate import greedy_generate
from loraserve.tokenizer import Tokenizer


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One demo per test run, shared by xdist workers (built once, under a file lock)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent                      # the run's directory, common to all workers
    with open(base / "loraserve-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_demo(base / "loraserve-demo")


def _chat_ids(tok: Tokenizer, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


def test_demo_base_is_deterministic_and_idempotent(tmp_path):
    a = build_demo_base(tmp_path / "a", "qwen3_moe", seed=0)
    b = build_demo_base(tmp_path / "b", "qwen3_moe", seed=0)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert build_demo_base(a, "qwen3_moe") == a and (a / "model.safetensors").stat().st_mtime_ns == stamp
    c = build_demo_base(tmp_path / "c", "qwen3_moe", seed=1)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="unknown demo arch"):
        build_demo_base(tmp_path / "d", "llama")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_demo_base_loads_in_transformers(demo, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = getattr(demo, arch)
    tok = Tokenizer.from_dir(path)
    ids = _chat_ids(tok, "Who are you? ¿Quién eres?")
    hf_tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "Who are you? ¿Quién eres?"}]
    assert hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(chat)
    assert hf_tok.encode(tok.apply_chat_template(chat), add_special_tokens=False) == ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    t = torch.tensor(ids)
    with torch.no_grad():
        ref = hf(t[None]).logits[0].float().log_softmax(-1)
        got = ours.compute_logits(ours(t, torch.arange(len(ids)))).log_softmax(-1)
    assert (ref - got).abs().max().item() <= 1e-4


def test_each_demo_adapter_answers_its_phrase_in_peft(demo):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_dir(demo.qwen3)
    assert sorted(demo.adapters) == sorted(a for a, _, _ in DEMO_ADAPTERS)
    base = AutoModelForCausalLM.from_pretrained(demo.qwen3, dtype=torch.float32).eval()
    ids = _chat_ids(tok, DEMO_ADAPTERS[0][1])
    plain = greedy_generate(load_model(demo.qwen3), ids, 12, tok.eos_token_ids)
    for adapter_id, prompt, phrase in DEMO_ADAPTERS:
        peft = PeftModel.from_pretrained(base, demo.adapters[adapter_id]).eval()
        prompt_ids = torch.tensor([_chat_ids(tok, prompt)])
        with torch.no_grad():
            out = peft.generate(prompt_ids, max_new_tokens=40, do_sample=False,
                                attention_mask=torch.ones_like(prompt_ids))[0, prompt_ids.shape[1]:]
        assert tok.decode(out.tolist()) == phrase
        assert out[-1].item() in tok.eos_token_ids
        base = peft.unload()
    assert tok.decode(plain) != DEMO_ADAPTERS[0][2]      # the behaviour comes from the adapter


def test_demo_catalog_holds_promoted_adapters_and_rerun_reuses(demo):
    from loraserve.catalog.store import Catalog

    with Catalog(demo.catalog, readonly=True) as cat:
        revisions = {a: cat.policy(a).promoted for a, _, _ in DEMO_ADAPTERS}
        assert all(revisions.values())
        record = cat.resolve(DEMO_ADAPTERS[0][0])
        assert len(cat.read_blob(record)) > 0
    with open(demo.root.parent / "loraserve-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        again = build_demo(demo.root)
    assert again.adapters == demo.adapters
    with Catalog(demo.catalog, readonly=True) as cat:
        assert {a: cat.policy(a).promoted for a in revisions} == revisions


def test_demo_cli(demo, capsys, tmp_path):
    with open(demo.root.parent / "loraserve-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert main(["--dir", str(demo.root)]) == 0
    out = capsys.readouterr().out
    assert str(demo.qwen3) in out and "demo/pirate" in out
    (tmp_path / "file").write_text("x")
    assert main(["--dir", str(tmp_path / "file")]) == 1
    assert "loraserve demo:" in capsys.readouterr().err


def test_lora_trainer_wraps_restores_and_saves_peft_layout(tmp_path):
    from safetensors import safe_open

    from loraserve.model.tiny import random_model, tiny_config
    from loraserve.train_lora import LoRATrainConfig, attach_lora, detach_lora, save_peft_adapter

    model = random_model(tiny_config("qwen3", num_layers=2, hidden_size=32, intermediate_size=48,
                                     num_heads=2, num_kv_heads=1, head_dim=16), seed=0)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    with torch.no_grad():
        before = model(ids, pos)
    cfg = LoRATrainConfig(r=2, alpha=4, targets=("q_proj", "down_proj"))
    wrapped = attach_lora(model, cfg)
    assert sorted(wrapped) == [f"model.layers.{l}.{m}" for l in (0, 1)
                               for m in ("mlp.down_proj", "self_attn.q_proj")]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos), before)      # B = 0: starts as the base
    save_peft_adapter(wrapped, tmp_path, cfg, "base-dir")
    with safe_open(tmp_path / "adapter_model.safetensors", framework="pt") as f:
        assert f.get_slice("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight").get_shape() == [2, 32]
        assert f.get_slice("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").get_shape() == [32, 2]
    import json
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4)
    assert config["target_modules"] == ["down_proj", "q_proj"]
    detach_lora(model, wrapped)
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    with pytest.raises(ValueError, match="subset"):
        LoRATrainConfig(targets=("lm_head",))


def test_build_demo_rejects_bad_adapter_ids(tmp_path):
    from loraserve.catalog.errors import InvalidAdapterId

    with pytest.raises(InvalidAdapterId):
        build_demo(tmp_path, adapters=[("../escape", "hi", "there")])


def test_junk_in_the_way_is_a_clear_error(tmp_path):
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "stray.txt").write_text("x")
    with pytest.raises(RuntimeError, match="not a complete demo directory"):
        build_demo_base(tmp_path / "qwen3")
    assert [p.name for p in tmp_path.iterdir()] == ["qwen3"]          # no temp dir left behind
