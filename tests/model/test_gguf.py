"""GGUF base files (loraserve/model/gguf.py): tiny GGUF files are written here with the gguf
package's own writer (llama.cpp's tensor names from gguf's name map, its Q/K row permutation for
Llama, a byte-level BPE tokenizer with merges and a ChatML template in the metadata), resolved
into a cached Hugging Face directory, loaded by `load_model` and compared with transformers
loading the same GGUF file; where transformers 5.25 cannot load a file (it takes Qwen3's head_dim
and Qwen3-MoE's expert width from its config defaults, not the file), with our own load of the
checkpoint the file was written from."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from loraserve.catalog.base import BaseInfo, base_fingerprint
from loraserve.model import load_model
from loraserve.model import gguf as gguf_mod
from loraserve.model.generate import greedy_generate
from loraserve.model.gguf import MARKER, GGUFError, cache_dir, is_gguf_file, resolve_base
from loraserve.model.tiny import CHATML_TEMPLATE, _bytes_to_unicode
from loraserve.tokenizer import Tokenizer

GG = gguf.GGMLQuantizationType
_B2U = _bytes_to_unicode()
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("a", "t"), ("Ġ", "c"),
          ("Ġc", "at"), ("o", "u")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [_B2U[b] for b in range(256)] + ["".join(m) for m in MERGES] + SPECIALS
VOCAB = len(TOKENS)
ENDOFTEXT, IM_START, IM_END = VOCAB - 3, VOCAB - 2, VOCAB - 1
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
PROMPTS = ["the cat", "Who are you? A cat in a hat", "ou"]
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))


# -- writing GGUF files as llama.cpp's converter does ------------------------------------------
def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (Q with n_head, K with n_head_kv)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(a: np.ndarray, qtype: GG) -> tuple[np.ndarray, GG | None]:
    """(array, raw_dtype) for GGUFWriter.add_tensor; 1-D tensors (norms, biases) stay F32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim == 1 or qtype == GG.F32:
        return a, None
    if qtype == GG.F16:
        return a.astype(np.float16), None
    return gguf.quants.quantize(a, qtype), qtype


def hf_tensors(model, qtype: GG = GG.F32) -> dict[str, tuple[np.ndarray, GG | None]]:
    """The GGUF tensors of a transformers model, named by gguf's own name map."""
    cfg = model.config
    gguf_arch = GGUF_ARCH[cfg.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], cfg.num_hidden_layers)
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if ".mlp.experts." in name:  # transformers 5's fused [E, 2I, H] gate_up and [E, H, I] down
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                half = a.shape[1] // 2
                out[f"blk.{layer}.ffn_gate_exps.weight"] = encode(a[:, :half], qtype)
                out[f"blk.{layer}.ffn_up_exps.weight"] = encode(a[:, half:], qtype)
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = encode(a, qtype)
            continue
        stem, suffix = name.rsplit(".", 1)
        if gguf_arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            a = llama_cpp_permute(a, cfg.num_attention_heads if stem.endswith("q_proj")
                                  else cfg.num_key_value_heads)
        out[f"{names.get_name(stem)}.{suffix}"] = encode(a, qtype)
    return out


def hf_meta(cfg) -> dict[str, object]:
    arch = GGUF_ARCH[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    meta = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": head_dim,
        "attention.value_length": head_dim, "rope.dimension_count": head_dim,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
    }
    if cfg.model_type == "qwen3_moe":
        meta.update({"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                     "expert_feed_forward_length": cfg.moe_intermediate_size})
    return {f"{arch}.{k}": v for k, v in meta.items()}


def write_gguf(path: Path, arch: str, tensors: dict, meta: dict, *, name: str = "tiny",
               tokenizer: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(TOKENS)
        w.add_token_types([1] * (VOCAB - len(SPECIALS)) + [3] * len(SPECIALS))
        w.add_token_merges([" ".join(m) for m in MERGES])
        w.add_bos_token_id(ENDOFTEXT)
        w.add_eos_token_id(IM_END)
        w.add_pad_token_id(ENDOFTEXT)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)
    for tname, (a, raw) in tensors.items():
        w.add_tensor(tname, a, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_of(model, path: Path, qtype: GG = GG.F32, **kwargs) -> Path:
    return write_gguf(path, GGUF_ARCH[model.config.model_type], hf_tensors(model, qtype),
                      hf_meta(model.config), **kwargs)


# -- references ------------------------------------------------------------------------------
def transformers_from_gguf(file: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                dtype=torch.float32).eval()


def _logprobs_ours(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).log_softmax(-1)


def _logprobs_hf(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float().log_softmax(-1)


def assert_matches(ours, ref, base: Path, atol: float = 1e-4) -> None:
    """Log-probs of random ids within `atol`, and greedy chat answers through our tokenizer equal."""
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    diff = (_logprobs_ours(ours, ids) - _logprobs_hf(ref, ids)).abs().max().item()
    assert diff <= atol, f"max |logprob diff| {diff}"
    tok = Tokenizer.from_dir(base)
    for prompt in PROMPTS:
        prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        with torch.no_grad():
            hf = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                              eos_token_id=tok.eos_token_ids, pad_token_id=ENDOFTEXT)
        assert greedy_generate(ours, prompt_ids, 8, tok.eos_token_ids) == hf[0, len(prompt_ids):].tolist()


def assert_same_weights(base: Path, source_dir: Path) -> None:
    """The converted checkpoint holds the source checkpoint's weights exactly (f32 round trip)."""
    ours, ref = load_model(base), load_model(source_dir)
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=0, msg=name)


# -- tensor types ------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [GG.F32, GG.F16, GG.BF16, GG.Q8_0, GG.Q4_0, GG.Q4_1], ids=lambda q: q.name)
def test_tensor_type_matches_transformers(qtype, tmp_path, make_hf):
    """A Llama file (Q/K rows permuted as llama.cpp stores them) of each type gives transformers'
    logits and greedy answers; F32 also gives back the source weights bit for bit."""
    source = make_hf("llama", **TINY)
    file = gguf_of(source, tmp_path / "gguf" / "tiny-llama.gguf", qtype)
    base = resolve_base(file)
    ours = load_model(base)
    assert_matches(ours, transformers_from_gguf(file), base)
    if qtype == GG.F32:
        source.save_pretrained(tmp_path / "hf")
        assert_same_weights(base, tmp_path / "hf")
        assert_matches(ours, source, base)  # also the model the file was written from


def k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: GG) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize to them) whose f16 super-block scales are
    small finite values that give weights of about unit-scale activations; [rows, bytes per row]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, n) * {GG.Q4_K: 4e-4, GG.Q5_K: 2e-4, GG.Q6_K: 6e-5}[qtype]).astype(np.float16)
    if qtype == GG.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[:, -2:] = d.view(np.uint8).reshape(n, 2)
    else:  # d dmin scales[12] (qh[32]) qs[128]: dmin centres d*sc*q - dmin*m near 0
        mean_q = 7.5 if qtype == GG.Q4_K else 15.5
        raw[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = (d.astype(np.float32) * mean_q).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", [GG.Q4_K, GG.Q5_K, GG.Q6_K], ids=lambda q: q.name)
def test_k_quant_matches_transformers(qtype, tmp_path, make_hf):
    """Every matrix as random K-quant blocks (rows of 256, so H 256): same logits and answers."""
    source = make_hf("llama", **{**TINY, "hidden_size": 256, "intermediate_size": 256, "head_dim": 64})
    rng = np.random.default_rng(int(qtype))
    tensors = {}
    for name, (a, raw) in hf_tensors(source).items():
        tensors[name] = (a, None) if a.ndim == 1 else (k_quant_blocks(rng, *a.shape, qtype), qtype)
    file = write_gguf(tmp_path / "gguf" / "k.gguf", "llama", tensors, hf_meta(source.config))
    assert {t.tensor_type for t in gguf.GGUFReader(str(file)).tensors} == {GG.F32, qtype}
    base = resolve_base(file)
    assert_matches(load_model(base), transformers_from_gguf(file), base)


# -- architectures -----------------------------------------------------------------------------
ARCH_CASES = {
    "llama-tied-q8_0": dict(arch="llama", tie=True, qtype=GG.Q8_0),
    "llama-named-mistral": dict(arch="llama", name="Mistral-7B-Instruct-v0.3"),  # served as llama
    "qwen2-biases": dict(arch="qwen2"),
    "qwen2-tied-f16": dict(arch="qwen2", tie=True, qtype=GG.F16),
    # transformers reads neither Qwen3's key_length nor Qwen3-MoE's expert width from a GGUF: these
    # shapes are its config defaults (head_dim 128, moe_intermediate_size 768)
    "qwen3": dict(arch="qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "qwen3_moe": dict(arch="qwen3_moe", num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                      num_experts=4, moe_intermediate_size=768),
}


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_architecture_matches_transformers(case, tmp_path, make_hf):
    spec = dict(ARCH_CASES[case])
    arch, qtype, name = spec.pop("arch"), spec.pop("qtype", GG.F32), spec.pop("name", "tiny")
    source = make_hf(arch, **{**TINY, **spec})
    file = gguf_of(source, tmp_path / "gguf" / "m.gguf", qtype, name=name)
    base = resolve_base(file)
    config = json.loads((base / "config.json").read_text())
    # what `--dtype auto` serves on CUDA: the file's own type, bfloat16 for quantized files
    served = {GG.F32: "float32", GG.F16: "float16"}.get(qtype, "bfloat16")
    assert config["model_type"] == arch and config["torch_dtype"] == config["dtype"] == served
    assert config["tie_word_embeddings"] == bool(spec.get("tie"))
    ours = load_model(base)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == bool(spec.get("tie"))
    assert_matches(ours, transformers_from_gguf(file), base)
    if qtype == GG.F32:
        source.save_pretrained(tmp_path / "hf")
        assert_same_weights(base, tmp_path / "hf")


@pytest.mark.parametrize("arch, spec, name", [
    ("qwen3", dict(head_dim=16), "tiny"),
    ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2), "tiny"),
    ("llama", dict(tie=True), "mistral"),
    ("llama", dict(attention_bias=True, mlp_bias=True), "tiny"),
], ids=["qwen3-head-dim-16", "qwen3_moe-expert-width-32", "llama-named-exactly-mistral",
        "llama-biases"])
def test_files_transformers_cannot_load_match_the_source(arch, spec, name, tmp_path, make_hf):
    """Files transformers 5.25's GGUF loader gets wrong (Qwen3 head_dim and Qwen3-MoE expert
    width other than its config defaults; a Llama file whose general.name is "mistral", which it
    fails to map; Llama biases, which it drops): the converted file equals the checkpoint it was
    written from (for the biases: Q/K biases un-permuted like the weights)."""
    source = make_hf(arch, **{**TINY, **spec})
    file = gguf_of(source, tmp_path / "gguf" / "m.gguf", name=name)
    source.save_pretrained(tmp_path / "hf")
    base = resolve_base(file)
    assert_same_weights(base, tmp_path / "hf")
    assert_matches(load_model(base), source, base)


@pytest.mark.parametrize("theta, original", [(500000.0, 8192), (10000.0, 64)],
                         ids=["meta-values", "fitted-band"])
def test_llama3_rope_freqs_become_llama3_rope_scaling(theta, original, tmp_path, make_hf):
    """Llama 3.1's scaling is stored as llama.cpp's rope_freqs tensor (transformers' GGUF loader
    drops it): read back, the model equals the source's, whose config has the llama3 rope."""
    rope = dict(rope_type="llama3", rope_theta=theta, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=original)
    source = make_hf("llama", rope_parameters=rope, max_position_embeddings=4 * original, **TINY)
    tensors = hf_tensors(source)
    head_dim, freqs = 16, 1.0 / theta ** (np.arange(0, 16, 2, dtype=np.float64) / 16)
    divisors = gguf_mod._llama3_factors(freqs, 8.0, 1.0, 4.0, original)  # as convert_hf_to_gguf
    assert 1.0 < divisors.max() and divisors.min() == 1.0
    tensors["rope_freqs.weight"] = (divisors.astype(np.float32), None)
    meta = hf_meta(source.config)
    file = write_gguf(tmp_path / "gguf" / "llama3.gguf", "llama", tensors, meta)
    base = resolve_base(file)
    ours = load_model(base)
    scaling = ours.config.rope_scaling
    assert scaling is not None and scaling.rope_type == "llama3" and scaling.factor == 8.0
    assert head_dim == ours.config.head_dim
    assert_matches(ours, source, base)


# -- tokenizer, catalog, CLI -------------------------------------------------------------------
def test_tokenizer_has_eos_template_and_transformers_ids(tmp_path, make_hf):
    from transformers import AutoTokenizer

    file = gguf_of(make_hf("qwen2", **TINY), tmp_path / "gguf" / "m.gguf")
    base = resolve_base(file)
    tok = Tokenizer.from_dir(base)
    # the file's EOS, then the control tokens llama.cpp also stops on by their text
    assert tok.eos_token_ids == [IM_END, ENDOFTEXT] and tok.vocab_size == VOCAB
    assert json.loads((base / "config.json").read_text())["eos_token_id"] == [IM_END, ENDOFTEXT]
    text = tok.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert text == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    ref = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for s in ("the cat in a hat", text, " outat\n\n  ü€"):
        ids = tok.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == s
    assert tok.encode(" cat") == [TOKENS.index("Ġcat")]  # merges applied
    assert json.loads((base / "config.json").read_text())["bos_token_id"] == ENDOFTEXT


def test_catalog_view_and_fingerprint_are_stable(tmp_path, make_hf, monkeypatch):
    """The same file converted in two caches: identical fingerprints (the conversion is
    deterministic), and the catalog sees every targetable module."""
    file = gguf_of(make_hf("qwen3_moe", **{**TINY, "num_experts": 4}), tmp_path / "gguf" / "m.gguf")
    first = resolve_base(file)
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "other-cache"))
    second = resolve_base(file)
    assert first != second and first.name == second.name
    assert base_fingerprint(first) == base_fingerprint(second)
    info = BaseInfo.from_dir(second)
    assert info.arch == "qwen3_moe" and info.num_experts == 4 and info.dtype == "float32"
    assert len(info.paths_for("experts.gate_proj")) == 2 and info.paths_for("lm_head") == ["lm_head"]


def test_engine_serves_a_converted_file(tmp_path, make_hf):
    """The engine (scheduler, KV cache, the real tokenizer, structured output) on a converted
    Q8_0 file: greedy answers equal the full-recompute reference."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.llm_engine import LLMEngine
    from loraserve.engine.types import GrammarSpec, SamplingParams

    base = resolve_base(gguf_of(make_hf("qwen2", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q8_0))
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", dtype="float32", max_model_len=128))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    model = load_model(base)
    assert engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0)) == [
        greedy_generate(model, p, 8, tok.eos_token_ids) for p in prompts]
    digits = GrammarSpec("regex", "[0-9]{3}")
    out = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, structured=digits))
    assert re.fullmatch("[0-9]{3}", tok.decode(out[0]))


def test_export_and_import_take_a_gguf_file(tmp_path, make_hf):
    """`loraserve export` / `catalog import --model FILE.gguf`: the adapter is checked against
    and exported for the converted base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraserve.catalog.format import read_adapter_meta
    from loraserve.cli_catalog import run

    file = gguf_of(make_hf("llama", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q4_0)
    base = resolve_base(file)
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "peft")
    out = tmp_path / "a.safetensors"
    assert run(["export", str(tmp_path / "peft"), "--model", str(file), "--out", str(out)]) == 0
    assert read_adapter_meta(out.read_bytes())["base_fingerprint"] == base_fingerprint(base)
    cat = str(tmp_path / "catalog")
    assert run(["catalog", "init", cat, "--shards", "2"]) == 0
    assert run(["catalog", "import", cat, "acme/a", str(tmp_path / "peft"), "--model", str(file)]) == 0


def test_serve_resolves_a_gguf_file_and_names_it_by_its_stem(tmp_path, make_hf, serve_config):
    file = gguf_of(make_hf("qwen2", **TINY), tmp_path / "gguf" / "Tiny-Qwen2.Q8_0.gguf", GG.Q8_0)
    cfg = serve_config(["--model", str(file)])
    assert Path(cfg.model_dir) == resolve_base(file) and cfg.model_dir.startswith(str(cache_dir()))
    assert cfg.model_name == "Tiny-Qwen2.Q8_0"
    named = serve_config(["--model", str(file), "--served-model-name", "qwen"])
    assert named.model_name == "qwen" and named.model_dir == cfg.model_dir
    toml = tmp_path / "serve.toml"
    toml.write_text(f'model = "{file}"\n')
    from_file = serve_config(["--config", str(toml)])
    assert from_file.model_dir == cfg.model_dir and from_file.model_name == "Tiny-Qwen2.Q8_0"
    plain = serve_config(["--model", cfg.model_dir])  # a directory: as it is
    assert plain.model_dir == cfg.model_dir and plain.model_name == Path(cfg.model_dir).name


def test_model_help_mentions_gguf():
    from loraserve.cli import build_parser
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert ".gguf" in next(a.help for a in serve._actions if "--model" in a.option_strings)


# -- bad inputs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> bytes:
    """A valid small Q8_0 Llama file's bytes (transformers' default init: the weights do not matter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, max_position_embeddings=256,
                                         tie_word_embeddings=True, **TINY))
    return gguf_of(model, tmp_path_factory.mktemp("small") / "s.gguf", GG.Q8_0).read_bytes()


def _raises(path: Path, *fragments: str) -> str:
    with pytest.raises(GGUFError) as e:
        resolve_base(path)
    message = str(e.value)
    assert str(path) in message and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_directory_is_returned_unchanged(tmp_path):
    assert resolve_base(tmp_path) == tmp_path and resolve_base(str(tmp_path)) == tmp_path
    assert not cache_dir().exists()


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    _raises(tmp_path / "model.gguf", "not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _raises(tmp_path / "empty.gguf", "not a GGUF file")
    _raises(tmp_path / "missing.gguf", "no such file")
    assert not is_gguf_file(tmp_path / "model.gguf") and not is_gguf_file(tmp_path)


@pytest.mark.parametrize("cut", [4, 10, 300, -1000, -1])
def test_truncated_gguf(cut, tmp_path, small_gguf):
    file = tmp_path / "cut.gguf"
    file.write_bytes(small_gguf[:cut])
    assert is_gguf_file(file)
    _raises(file, "truncated GGUF file")
    assert [p.name for p in cache_dir().iterdir() if not p.name.endswith(".lock")] == []


def test_unsupported_architecture(tmp_path):
    meta = {"gpt2.context_length": 64, "gpt2.embedding_length": 64, "gpt2.block_count": 1}
    tensors = {"token_embd.weight": encode(np.ones((VOCAB, 64)), GG.F32)}
    file = write_gguf(tmp_path / "gpt2.gguf", "gpt2", tensors, meta)
    _raises(file, "unsupported architecture 'gpt2'", "llama, qwen2, qwen3, qwen3moe")


@pytest.mark.parametrize("qtype", [GG.Q5_0, GG.Q5_1, GG.IQ2_XXS], ids=lambda q: q.name)
def test_unsupported_tensor_type(qtype, tmp_path, make_hf):
    tensors = hf_tensors(make_hf("llama", **TINY))
    if qtype == GG.IQ2_XXS:  # gguf-py cannot quantize to it: raw blocks, rows of 256
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        tensors["blk.0.ffn_down.weight"] = (np.zeros((64, 512 // block * size), np.uint8), qtype)
        tensors["blk.0.ffn_up.weight"] = encode(np.ones((512, 64)), GG.F32)
    else:
        tensors["blk.0.ffn_down.weight"] = encode(np.ones((64, 128)), qtype)
    file = write_gguf(tmp_path / "q.gguf", "llama", tensors, hf_meta(make_hf("llama", **TINY).config))
    _raises(file, f"unsupported tensor type {qtype.name} for tensor blk.0.ffn_down.weight",
            "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K")


def test_metadata_and_tensors_that_do_not_fit(tmp_path, make_hf):
    model = make_hf("llama", **TINY)
    meta = hf_meta(model.config)
    no_ff = {k: v for k, v in meta.items() if k != "llama.feed_forward_length"}
    _raises(write_gguf(tmp_path / "a.gguf", "llama", hf_tensors(model), no_ff), "llama.feed_forward_length")
    _raises(write_gguf(tmp_path / "b.gguf", "llama", hf_tensors(model), meta, tokenizer=False),
            "tokenizer.ggml.tokens")
    extra = {**hf_tensors(model), "blk.0.ffn_norm_extra.weight": encode(np.ones(64), GG.F32)}
    _raises(write_gguf(tmp_path / "c.gguf", "llama", extra, meta), "blk.0.ffn_norm_extra.weight")
    missing = {k: v for k, v in hf_tensors(model).items() if k != "blk.1.attn_v.weight"}
    _raises(write_gguf(tmp_path / "d.gguf", "llama", missing, meta),
            "model.layers.1.self_attn.v_proj.weight", "missing")
    wide = {**meta, "llama.embedding_length": 96}
    _raises(write_gguf(tmp_path / "e.gguf", "llama", hf_tensors(model), wide), "shape")
    yarn = {**meta, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    _raises(write_gguf(tmp_path / "f.gguf", "llama", hf_tensors(model), yarn), "rope scaling 'yarn'")
    split = {**meta, "split.count": 3}
    _raises(write_gguf(tmp_path / "h.gguf", "llama", hf_tensors(model), split), "split in 3", "merge")
    nan = hf_tensors(model)
    nan["blk.0.attn_v.weight"] = encode(np.full((32, 64), np.nan), GG.F32)
    _raises(write_gguf(tmp_path / "g.gguf", "llama", nan, meta), "non-finite", "blk.0.attn_v.weight")
    assert not [p for p in cache_dir().iterdir() if not p.name.endswith(".lock")]  # nothing left


# -- the cache ---------------------------------------------------------------------------------
def test_second_resolve_reuses_the_folder(tmp_path, make_hf, monkeypatch):
    file = gguf_of(make_hf("llama", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q4_0)
    base = resolve_base(file)
    assert base.parent == cache_dir() and (base / MARKER).is_file()
    marker = json.loads((base / MARKER).read_text())
    assert marker["source"] == str(file.resolve())
    assert marker["converter_version"] == gguf_mod.CONVERTER_VERSION
    stamp = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "_convert", no_conversion)
    assert resolve_base(file) == base and resolve_base(str(file)) == base
    assert {p.name: p.stat().st_mtime_ns for p in base.iterdir()} == stamp
    copy = tmp_path / "elsewhere" / "weights.bin"
    copy.parent.mkdir()
    copy.write_bytes(file.read_bytes())
    assert resolve_base(copy) == base  # keyed by the bytes (the magic, not the suffix, says GGUF)
    other = bytearray(file.read_bytes())
    other[-1] ^= 1
    (tmp_path / "other.gguf").write_bytes(bytes(other))
    with pytest.raises(AssertionError, match="converted again"):
        resolve_base(tmp_path / "other.gguf")


def test_a_folder_without_its_marker_is_rebuilt(tmp_path, make_hf):
    file = gguf_of(make_hf("llama", **TINY), tmp_path / "gguf" / "m.gguf", GG.F16)
    base = resolve_base(file)
    weights = (base / "model.safetensors").read_bytes()
    (base / MARKER).unlink()
    (base / "model.safetensors").write_bytes(b"half written")
    (base / "junk").write_text("left by a crash")
    assert resolve_base(file) == base
    assert (base / MARKER).is_file() and not (base / "junk").exists()
    assert (base / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in cache_dir().iterdir() if not p.name.endswith(".lock")) == [base.name]


def test_a_crash_leaves_no_folder_behind(tmp_path, make_hf, monkeypatch):
    file = gguf_of(make_hf("llama", **TINY), tmp_path / "gguf" / "m.gguf")
    real = gguf_mod._write_weights

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_mod, "_write_weights", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_base(file)
    assert [p.name for p in cache_dir().iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(gguf_mod, "_write_weights", real)
    assert (resolve_base(file) / MARKER).is_file()


def test_concurrent_resolves_convert_once(tmp_path, make_hf, monkeypatch):
    file = gguf_of(make_hf("llama", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q8_0)
    real, calls = gguf_mod._convert, []

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(gguf_mod, "_convert", counted)
    results, errors = [], []

    def start():
        try:
            results.append(resolve_base(file))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(calls) == 1


# -- garbage in: GGUFError or success, nothing else ------------------------------------------------
@st.composite
def damaged(draw, data: bytes, header_end: int) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "flip-header", "insert", "garbage"]))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "garbage":
        return b"GGUF" + draw(st.binary(max_size=256))
    if kind == "insert":
        at = draw(st.integers(4, header_end))
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    out = bytearray(data)
    top = header_end if kind == "flip-header" else len(data) - 1
    flips = st.lists(st.tuples(st.integers(4, top), st.integers(0, 255)), min_size=1, max_size=4)
    for at, value in draw(flips):
        out[at] = value
    return bytes(out)


@pytest.fixture(scope="module")
def small_gguf_header_end(small_gguf, tmp_path_factory) -> int:
    file = tmp_path_factory.mktemp("hdr") / "s.gguf"
    file.write_bytes(small_gguf)
    return gguf.GGUFReader(str(file)).data_offset


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_files_raise_gguf_error_or_convert(data, tmp_path, small_gguf, small_gguf_header_end):
    blob = data.draw(damaged(small_gguf, small_gguf_header_end))
    file = tmp_path / "damaged.gguf"
    file.write_bytes(blob)
    try:
        base = resolve_base(file)
    except GGUFError as e:
        assert str(file) in str(e) and "\n" not in str(e)
    else:
        assert (base / MARKER).is_file() and (base / "model.safetensors").is_file()
    leftovers = [p for p in cache_dir().iterdir() if ".tmp-" in p.name] if cache_dir().exists() else []
    assert leftovers == []
