"""Quantized bases (model/quant.py, quant_gguf.py, quant_load.py, kernels/cpu_quant): the packed
layout, the VNNI kernel against the dequantized weight, GGUF blocks repacked bit for bit,
`--quantize int8|int4` from a float checkpoint, adapters on a quantized base against PEFT on
the dequantized one, the fingerprint rule, and the start-up refusals.

Tolerances, stated once: the served kernel takes float activations and makes each weight as
`dequantize` does, so a quantized layer's product equals the float product with its dequantized
weight to float rounding (1e-5; against float64, KERNEL_FLOAT_TOL of sum |x w|), and a
model's log-probs the dequantized model's within LOGPROB_ATOL, at decode's few rows (the kernel)
and at prefill's many (a GEMM over the dequantized weight). The VNNI variant the bench also
measures rounds activations to int8 per 32 inputs (as llama.cpp does): within KERNEL_RTOL of
max |y|.
"""
from __future__ import annotations

import copy
import pickle
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from loraserve.adapters.limits import check_base
from loraserve.catalog.base import QuantizedFingerprint, base_fingerprint, served_fingerprint
from loraserve.catalog.errors import BaseMismatch
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.kernels import cpu_quant
from loraserve.model import load_model
from loraserve.model.gguf import GGUFError, resolve_base
from loraserve.model.quant import (KERNELS, QuantLinear, Scheme, pack_codes, quant_linear_of, quantize_weight,
                                   unpack_codes)
from loraserve.model.quant_gguf import repack_gguf, source_file
from test_gguf import TINY, VOCAB, gguf_of

GG = gguf.GGMLQuantizationType
KERNEL_RTOL = 0.03
KERNEL_FLOAT_TOL = 1e-5
LOGPROB_ATOL = 1e-4
SCHEMES = [Scheme(8, 0), Scheme(8, 32), Scheme(4, 32), Scheme(4, 64), Scheme(4, 128)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))


def test_the_kernel_builds_here():
    """The dev and CI machines have AVX512-VNNI: the kernel must be what runs, not the fallback."""
    assert cpu_quant.available()


# -- the layer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_codes_round_trip_within_half_a_step(scheme):
    w = torch.randn(48, 256)
    codes, scales, mins, group = quantize_weight(w, scheme)
    layer = QuantLinear(codes, scales, mins, scheme.bits, group, 256)
    assert layer.codes.dtype == torch.uint8 and layer.codes.shape == (48, 256 * scheme.bits // 8)
    assert int(unpack_codes(codes, scheme.bits, 256).max()) < 2 ** scheme.bits
    step = scales.float().repeat_interleave(group, dim=1)
    assert ((layer.dequantized() - w).abs() <= 0.5 * step + 1e-3 * w.abs().max()).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 6, KERNELS["int4"] + 1])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_the_layer_equals_the_dequantized_weight(scheme, rows):
    """The served kernel (float activations) and prefill's GEMM: the dequantized weight's product
    to float rounding; the VNNI variant (activations in int8) within KERNEL_RTOL."""
    torch.manual_seed(rows)
    layer = quant_linear_of(nn.Linear(192, 136, bias=True), scheme)  # 136 rows: an odd tail
    x = torch.randn(rows, 192)
    ref = torch.nn.functional.linear(x, layer.dequantized(), layer.bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    vnni = cpu_quant.quant_linear(x, layer.codes, layer.scales, layer.mins, layer.bits, layer.group, True)
    assert (vnni + layer.bias - ref).abs().max() <= KERNEL_RTOL * ref.abs().max()


def _random_packed(n: int, k: int, bits: int, group: int, gen: torch.Generator):
    """Codes over the whole range, scales and mins over several magnitudes: (codes, scales, mins)
    in the stored layout, the float64 weight they stand for, and |scale q| + |min| (float64)."""
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 10.0 ** torch.randint(-3, 1, (n, k // group), generator=gen)).half()
    mins = (-8 * scales.float() * torch.rand(n, k // group, generator=gen)).half()
    sq = q.double().view(n, -1, group) * scales.double().unsqueeze(-1)
    m = mins.double().unsqueeze(-1).expand_as(sq)
    return pack_codes(q, bits), scales, mins, (sq + m).reshape(n, k), (sq.abs() + m.abs()).reshape(n, k)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (4, 96), (4, 128), (8, 32), (8, 128), (8, 0)],
                         ids=lambda v: str(v))
def test_the_float_kernels_equal_the_float64_product(bits, group, threads):
    """The served table kernel against float64 over random shapes and 1-70 rows: |y - y64| <=
    KERNEL_FLOAT_TOL * sum_i |x_i w_i| per output, float32 summation's own error, as a GEMM over
    the dequantized weight has. The float kernel it replaced sums scale * q and min apart, so its
    bound is over |x| (|scale q| + |min|)."""
    assert cpu_quant.available()  # loads the library's ops
    gen = torch.Generator().manual_seed(bits * 1000 + group + threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k, rows in [(1, 192, 1), (19, 384, 2), (53, 576, 3), (136, 192, 4), (40, 768, 5), (67, 384, 70),
                           (33, 1152, 16), (96, 192, 9)]:
            g = group or k
            if k % g:
                continue
            codes, scales, mins, w, parts = _random_packed(n, k, bits, g, gen)
            x = torch.randn(rows, k, generator=gen) * 10.0 ** torch.randint(-2, 2, (rows, 1), generator=gen)
            ref, xabs = x.double() @ w.t(), x.double().abs()
            for kernel, bound in (("table", xabs @ w.abs().t()), ("float-v1", xabs @ parts.t())):
                y = cpu_quant.quant_linear_kernel(x, codes, scales, mins, bits, g, kernel)
                assert ((y.double() - ref).abs() <= KERNEL_FLOAT_TOL * bound).all(), (kernel, n, k, rows)
            served = cpu_quant.quant_linear(x, codes, scales, mins, bits, g)
            torch.testing.assert_close(served, cpu_quant.quant_linear_kernel(x, codes, scales, mins, bits, g, "table"),
                                       rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("streams, ahead", [(2, 0), (4, 512), (8, 256)])
def test_every_table_kernel_variant_gives_the_same_product(streams, ahead):
    """The bench's variants (output rows read at once, prefetch distance) change only the reading."""
    assert cpu_quant.available()
    gen = torch.Generator().manual_seed(streams)
    codes, scales, mins, _, _ = _random_packed(45, 256, 4, 64, gen)
    x = torch.randn(6, 256, generator=gen)
    y = cpu_quant.quant_linear_kernel(x, codes, scales, mins, 4, 64, "table", streams, ahead)
    torch.testing.assert_close(y, cpu_quant.quant_linear(x, codes, scales, mins, 4, 64), rtol=0, atol=0)


def test_a_group_that_does_not_divide_takes_the_largest_that_does():
    _, scales, _, group = quantize_weight(torch.randn(8, 576), Scheme(4, 128))  # SmolLM2's hidden
    assert group == 64 and scales.shape == (8, 9)


# -- GGUF files: repacked, not dequantized -------------------------------------------------------
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).log_softmax(-1)


def _assert_close_to(model, ref) -> None:
    """One-row and prefill log-probs of `model` against `ref` (module doc's tolerances)."""
    ids = torch.randint(0, VOCAB, (KERNELS["int4"] + 8,), generator=torch.Generator().manual_seed(3))
    for n in (1, 2, len(ids)):  # the kernel, and prefill's GEMM
        diff = (_logprobs(model, ids[:n]) - _logprobs(ref, ids[:n])).abs().max()
        assert diff <= LOGPROB_ATOL, (n, diff)


@pytest.mark.parametrize("qtype", [GG.Q8_0, GG.Q4_0, GG.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_quantized_gguf_is_served_repacked(arch, qtype, tmp_path, make_hf):
    """Default flags: the file's blocks become QuantLinears holding exactly the dequantized
    directory's weights (llama's Q/K rows un-permuted too); logits within the stated tolerance."""
    base = resolve_base(gguf_of(make_hf(arch, **TINY), tmp_path / "gguf" / "m.gguf", qtype))
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64))
    assert engine.quantization == f"gguf-{qtype.name}"
    ref = load_model(base)
    ref.fuse_projections()
    quantized = {n: m for n, m in engine.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 4 * 2 + 1  # qkv, o, gate_up, down of each of 2 layers, and the head
    plain = dict(ref.named_modules())
    for name, layer in quantized.items():
        torch.testing.assert_close(layer.dequantized(), plain[name].weight, rtol=0, atol=0, msg=name)
    _assert_close_to(engine.model, ref)


def test_dequantize_and_an_explicit_dtype_serve_the_float_weights(tmp_path, make_hf):
    base = resolve_base(gguf_of(make_hf("qwen3", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q4_1))
    for cfg in (dict(quantize="none"), dict(dtype="float32")):
        engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64, **cfg))
        assert engine.quantization is None
        assert not any(isinstance(m, QuantLinear) for m in engine.model.modules())


def test_a_non_finite_scale_is_refused_at_load(tmp_path, make_hf):
    file = gguf_of(make_hf("qwen3", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q4_1)
    base = resolve_base(file)  # converted while the file was sound
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors if t.name == "blk.1.ffn_up.weight")
    with open(file, "r+b") as f:
        f.seek(int(tensor.data_offset))
        f.write(np.array([np.inf], dtype=np.float16).tobytes())  # the first block's scale
    model = load_model(base)
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight has non-finite scales") as err:
        repack_gguf(model, source_file(base), "qwen3")
    assert str(file) in str(err.value)


# -- --quantize int8 | int4 from a float checkpoint ----------------------------------------------
def _dequantized_twin(model: nn.Module) -> nn.Module:
    """model with every QuantLinear swapped for an nn.Linear of its dequantized weight."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                plain.weight = nn.Parameter(child.dequantized(), requires_grad=False)
                plain.bias = child.bias
                setattr(parent, name, plain)
    return model


@pytest.mark.parametrize("setting, group, name", [("int8", None, "int8-channel"), ("int4", 32, "int4-g32"),
                                                  ("int4", None, "int4-g64"), ("int4", 128, "int4-g128")])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantize_flag_quantizes_a_float_checkpoint(arch, setting, group, name, tmp_path, make_hf):
    """`--quantize` on a float directory: every linear quantized (a 64-input layer takes group 64
    when 128 is asked), logits within tolerance of the same model over the dequantized weights."""
    hf = resolve_base(gguf_of(make_hf(arch, **TINY), tmp_path / "gguf" / "f32.gguf"))  # a float base
    engine = LLMEngine(EngineConfig(model_dir=str(hf), device="cpu", max_model_len=64,
                                    quantize=setting, quantize_group=group))
    assert engine.quantization == name
    assert not any(type(m) is nn.Linear for m in engine.model.modules())
    groups = {m.group for m in engine.model.modules() if isinstance(m, QuantLinear)}
    # per channel (int8) is the layer's inputs: 64 or 128; a 64-input layer takes 64 when 128 is asked
    assert groups == ({64, 128} if setting == "int8" or group == 128 else {group or 64})
    _assert_close_to(engine.model, _dequantized_twin(copy.deepcopy(engine.model)))


def test_a_bad_group_or_scheme_is_refused_by_name():
    with pytest.raises(ValueError, match="group size 48"):
        EngineConfig(model_dir="x", quantize="int4", quantize_group=48)
    with pytest.raises(ValueError, match="int3"):
        EngineConfig(model_dir="x", quantize="int3")


# -- adapters and the fingerprint ------------------------------------------------------------------
def test_the_fingerprint_names_the_quantization_and_says_which_adapters_fit():
    lossless = served_fingerprint("f" * 32, "gguf-Q4_1+Q8_0", allow_float=False)
    assert lossless == "f" * 32 + "+gguf-Q4_1+Q8_0" and lossless.accepts("f" * 32)
    lossy = served_fingerprint("f" * 32, "int4-g64", allow_float=False)
    check_base("a/b@1", lossy, lossy)  # an adapter trained on the quantized base itself
    with pytest.raises(BaseMismatch, match="--allow-quantized-base-adapters") as err:
        check_base("a/b@1", "f" * 32, lossy)
    assert err.value.status == 409
    check_base("a/b@1", "f" * 32, served_fingerprint("f" * 32, "int4-g64", allow_float=True))
    with pytest.raises(BaseMismatch):
        check_base("a/b@1", "e" * 32, served_fingerprint("f" * 32, "int4-g64", allow_float=True))
    assert served_fingerprint("f" * 32, None, allow_float=False) == "f" * 32
    again = pickle.loads(pickle.dumps(lossy))
    assert isinstance(again, QuantizedFingerprint) and again == lossy and not again.accepts("f" * 32)


def _peft_adapter(base: Path, out: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)  # a delta large enough to move the answers
    model.save_pretrained(out)
    return model.eval()


def _catalog_with(adapter_dir: Path, model: Path, tmp_path: Path) -> str:
    from loraserve.cli_catalog import run

    cat = str(tmp_path / "catalog")
    assert run(["catalog", "init", cat, "--shards", "1"]) == 0
    assert run(["catalog", "import", cat, "acme/a", str(adapter_dir), "--model", str(model)]) == 0
    return cat


def test_an_adapter_on_a_quantized_gguf_base_matches_peft_on_the_dequantized_one(tmp_path, make_hf):
    """Served through the engine (LoRA beside the quantized GEMMs): the greedy answers are PEFT's
    on the dequantized base (each token PEFT's pick, within LOGPROB_ATOL of its best)."""
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import SamplingParams

    file = gguf_of(make_hf("llama", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q4_1)
    base = resolve_base(file)
    peft = _peft_adapter(base, tmp_path / "peft")
    cat = _catalog_with(tmp_path / "peft", file, tmp_path)
    engine = build_engine(EngineConfig(model_dir=str(base), catalog_dir=cat, device="cpu", compile="off",
                                       max_model_len=64))
    assert engine.quantization == "gguf-Q4_1"
    prompt = [5, 17, 99, 3, 42, 7]
    out = engine.generate([prompt, prompt], SamplingParams(max_tokens=8, temperature=0), ["acme/a", None])
    with torch.no_grad():
        ids = torch.tensor([prompt + out[0]])
        with_adapter = peft(ids).logits[0].log_softmax(-1)
        with peft.disable_adapter():
            without = peft(torch.tensor([prompt + out[1]])).logits[0].log_softmax(-1)
    for logprobs, answer in ((with_adapter, out[0]), (without, out[1])):
        for i, token in enumerate(answer):
            step = logprobs[len(prompt) - 1 + i]
            assert step.max() - step[token] <= LOGPROB_ATOL, (i, token, int(step.argmax()))
    assert out[0] != out[1]  # the adapter moved the answer


def test_a_float_base_adapter_is_refused_on_an_int4_base_unless_allowed(tmp_path, make_hf):
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import SamplingParams

    hf = resolve_base(gguf_of(make_hf("qwen3", **TINY), tmp_path / "gguf" / "f32.gguf"))  # a float base
    _peft_adapter(hf, tmp_path / "peft")
    cat = _catalog_with(tmp_path / "peft", hf, tmp_path)
    cfg = dict(model_dir=str(hf), catalog_dir=cat, device="cpu", compile="off",
               max_model_len=64, quantize="int4")
    engine = build_engine(EngineConfig(**cfg))
    assert engine.adapters.base_fingerprint == base_fingerprint(hf) + "+int4-g64"
    with pytest.raises(BaseMismatch, match="allow-quantized-base-adapters"):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), ["acme/a"])
    allowed = build_engine(EngineConfig(**cfg, allow_quantized_base_adapters=True))
    assert len(allowed.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), ["acme/a"])[0]) == 2


def test_serve_flags_reach_the_engine_config(tmp_path, make_hf, serve_config):
    file = gguf_of(make_hf("qwen3", **TINY), tmp_path / "gguf" / "m.gguf", GG.Q4_1)
    assert serve_config(["--model", str(file)]).quantize == "auto"  # a quantized file stays quantized
    assert serve_config(["--model", str(file), "--dequantize"]).quantize == "none"
    cfg = serve_config(["--model", str(file), "--quantize", "int4", "--quantize-group", "128",
                        "--allow-quantized-base-adapters"])
    assert (cfg.quantize, cfg.quantize_group, cfg.allow_quantized_base_adapters) == ("int4", 128, True)
    with pytest.raises(SystemExit):  # argparse: 48 is no choice
        serve_config(["--model", str(file), "--quantize", "int4", "--quantize-group", "48"])


def test_gradients_flow_to_the_input_not_to_the_quantized_weight():
    """Training LoRA through a quantized base: the layer passes gradients to its input (the GEMM
    over the dequantized weight) and has no parameter of its own to train."""
    layer = quant_linear_of(nn.Linear(128, 64, bias=False), Scheme(4, 64))
    assert not any(p.requires_grad for p in layer.parameters())
    x = torch.randn(2, 128, requires_grad=True)
    layer(x).square().sum().backward()
    w = layer.dequantized()
    torch.testing.assert_close(x.grad, 2 * (x.detach() @ w.t()) @ w, rtol=1e-4, atol=1e-4)


def test_the_same_bytes_at_another_path_serve_quantized_after_the_first_is_gone(tmp_path, make_hf):
    """The converted directory is found by the file's bytes; its marker then names the path this
    start was given, so a copy (or a moved file) is still repacked from, never silently served
    dequantized because the file first converted has gone."""
    first = gguf_of(make_hf("qwen3", **TINY), tmp_path / "a" / "m.gguf", GG.Q4_1)
    assert source_file(resolve_base(first)) == first.resolve()
    copy_path = tmp_path / "b" / "m.gguf"
    copy_path.parent.mkdir()
    copy_path.write_bytes(first.read_bytes())
    first.unlink()
    base = resolve_base(copy_path)
    assert source_file(base) == copy_path.resolve()
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64))
    assert engine.quantization == "gguf-Q4_1"


def test_a_directory_whose_gguf_is_gone_says_so_and_serves_float(tmp_path, make_hf, caplog):
    file = gguf_of(make_hf("qwen3", **TINY), tmp_path / "m.gguf", GG.Q4_1)
    base = resolve_base(file)
    file.unlink()
    with caplog.at_level("WARNING"):
        engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64))
    assert engine.quantization is None
    assert "is gone" in caplog.text and str(file.resolve()) in caplog.text
