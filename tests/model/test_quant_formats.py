"""Quantized bases, more ways in (model/quant_gguf.py, quant_hf.py): GGUF K-quants repacked
against the `gguf` package's own dequantizer, a Q4_K_M-style file (Q4_K + Q6_K) served, AWQ and
GPTQ checkpoints in Hugging Face format repacked against the formula w = s (q - z), and the
start-up refusals (one line naming the file and what is wrong).

Tolerances, stated once. A K-quant's sub-block scale d sc and min dmin m, and an AWQ/GPTQ min
s z, are products the layout stores rounded to float16: each served weight is within F16_REL
(half a float16 step, relative) of those products' sizes (plus F16_ABS, half the smallest
subnormal step) of the reference weight, and a product of the layer within the same bound
carried through |x|. That rounding moves these tiny models' log-probs by up to a few 1e-2 (the
weights are small differences of larger products), so the whole-model parity runs on files whose
d, dmin or s are cut to a few significant bits (`short_f16`): the products are then float16
values, the repack exact, and log-probs equal the reference's within LOGPROB_ATOL (float
rounding, test_quant.py's), at decode's few rows (the kernel) and prefill's many.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loraserve.catalog.base import base_fingerprint, served_fingerprint
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.model import load_model
from loraserve.model.gguf import MARKER, GGUFError, resolve_base
from loraserve.model.quant import KERNELS, QuantError, QuantLinear
from loraserve.model.quant_gguf import repack_gguf, source_file
from test_gguf import TINY, VOCAB, hf_meta, hf_tensors, k_quant_blocks, write_gguf

GG = gguf.GGMLQuantizationType
F16_REL, F16_ABS = 2.0 ** -11 * (1 + 2.0 ** -9), 2.0 ** -25  # with a margin for float32 sums
LOGPROB_ATOL = 1e-4
K_SHAPES = dict(TINY, hidden_size=256, intermediate_size=256, head_dim=64)  # rows of 256 values


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).log_softmax(-1)


def _assert_close_to(model, ref, atol: float) -> None:
    """One-row (the kernel) and prefill (a GEMM over the dequantized weight) log-probs."""
    ids = torch.randint(0, VOCAB, (KERNELS["int4"] + 8,), generator=torch.Generator().manual_seed(3))
    for n in (1, 2, len(ids)):
        diff = (_logprobs(model, ids[:n]) - _logprobs(ref, ids[:n])).abs().max()
        assert diff <= atol, (n, diff)


def _quantized(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _assert_within(layer: QuantLinear, reference: torch.Tensor, bound: torch.Tensor) -> None:
    """The layer's weight within `bound` [N, K] of `reference`, and its product within the bound
    carried through |x| (plus float rounding of the sums)."""
    assert ((layer.dequantized() - reference).abs() <= bound).all()
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    slack = x.abs() @ (bound + 1e-6 * reference.abs()).t() + 1e-5
    assert ((layer(x) - x @ reference.t()).abs() <= slack).all()


# -- GGUF K-quants -------------------------------------------------------------------------------
def short_f16(a: np.ndarray, bits: int) -> np.ndarray:
    """float16 values cut to their top `bits` significant bits (the rest of the mantissa zero):
    a product with a number of 11 - bits bits is then exact in float16."""
    keep = np.uint16(~((1 << (11 - bits)) - 1) & 0xFFFF)
    return (np.ascontiguousarray(a, dtype=np.float16).view(np.uint16) & keep).view(np.float16)


def _k_file(tmp_path: Path, make_hf, arch: str, qtype_of, *, exact: bool = False) -> Path:
    """A GGUF file of a tiny model whose matrices are random K-quant blocks, `qtype_of(name)`
    their type (F32 for None). `exact`: Q4_K/Q5_K's d and dmin cut to 5 significant bits, so that
    d sc and dmin m (6-bit sc, m) are float16 values and the repack is exact."""
    source = make_hf(arch, **K_SHAPES)
    rng = np.random.default_rng(7)
    tensors = {}
    for name, (a, raw) in hf_tensors(source).items():
        qtype = qtype_of(name) if a.ndim == 2 else None
        if qtype is None:
            tensors[name] = (a, None)
            continue
        blocks = k_quant_blocks(rng, *a.shape, qtype)
        if exact and qtype in (GG.Q4_K, GG.Q5_K):
            size = gguf.GGML_QUANT_SIZES[qtype][1]
            heads = blocks.reshape(-1, size)[:, :4]  # d, dmin
            heads[:] = short_f16(heads.copy().view(np.float16), 5).view(np.uint8)
        tensors[name] = (blocks, qtype)
    return write_gguf(tmp_path / "gguf" / "k.gguf", arch, tensors, hf_meta(source.config))


def _gguf_weights(file: Path) -> dict[str, tuple[torch.Tensor, GG]]:
    """Each matrix as the gguf package's own dequantizer gives it, [N, K] float32, and its type."""
    out = {}
    for t in gguf.GGUFReader(str(file)).tensors:
        if len(t.shape) == 2:
            n, k = (int(d) for d in reversed(t.shape.tolist()))
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k)
            out[t.name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), t.tensor_type
    return out


def _f16_bound(layer: QuantLinear) -> torch.Tensor:
    """|served - reference| bound of a layer whose scale and min are rounded products: half a
    float16 step of the largest code times the scale, and of the min."""
    top = 2 ** layer.bits - 1 if layer.bits == 4 else 31  # Q5_K's 5-bit codes in int8
    per_group = F16_REL * (top * layer.scales.float().abs() + layer.mins.float().abs()) + (top + 1) * F16_ABS
    return per_group.repeat_interleave(layer.group, dim=1)


@pytest.mark.parametrize("qtype, bits", [(GG.Q4_K, 4), (GG.Q5_K, 8)], ids=["Q4_K", "Q5_K"])
def test_a_k_quant_file_is_repacked_to_the_gguf_dequantizer(qtype, bits, tmp_path, make_hf):
    """Every matrix Q4_K (int4) or Q5_K (int8 codes 0..31), group 32: each repacked layer is
    gguf's dequantized weight within the float16 rounding of d sc and dmin m (module doc), its
    product too; a wrong nibble order or scale unpacking would be off by whole steps."""
    file = _k_file(tmp_path, make_hf, "qwen3", lambda name: qtype)
    base = resolve_base(file)
    model = load_model(base)
    assert repack_gguf(model, source_file(base), "qwen3") == f"gguf-{qtype.name}"
    reference = _gguf_weights(file)
    layers = _quantized(model)
    assert len(layers) == 7 * 2 + 1  # q, k, v, o, gate, up, down of each of 2 layers, and the head
    names = {"lm_head": "output.weight"}
    for path, layer in layers.items():
        assert (layer.bits, layer.group) == (bits, 32), path
        gguf_name = names.get(path) or _gguf_name(path)
        _assert_within(layer, reference[gguf_name][0], _f16_bound(layer))


def _gguf_name(module_path: str) -> str:
    parts = module_path.split(".")  # model.layers.<i>.<self_attn|mlp>.<x_proj>
    kind = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[parts[4]]
    return f"blk.{parts[2]}.{kind}.weight"


def _q4_k_m(name: str) -> GG:
    """llama.cpp's Q4_K_M recipe, shrunk: Q6_K for the head and one layer's ffn_down."""
    return GG.Q6_K if name in ("output.weight", "blk.1.ffn_down.weight") else GG.Q4_K


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_q4_k_m_file_serves_q4_k_repacked_and_q6_k_float(arch, tmp_path, make_hf, caplog):
    """Default flags on Q4_K + Q6_K: Q4_K linears repacked, Q6_K ones the dequantized floats
    bit for bit, named in one log line; logits against the gguf-dequantized model within
    LOGPROB_ATOL (exact scales: module doc)."""
    base = resolve_base(_k_file(tmp_path, make_hf, arch, _q4_k_m, exact=True))
    with caplog.at_level(logging.INFO, logger="loraserve.model.quant_gguf"):
        engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64))
    assert engine.quantization == "gguf-Q4_K+Q6_K"
    lines = [r.getMessage() for r in caplog.records if r.name == "loraserve.model.quant_gguf"]
    assert len(lines) == 1 and "output.weight" in lines[0] and "blk.1.ffn_down.weight" in lines[0], lines
    ref = load_model(base)
    ref.fuse_projections()
    served = dict(engine.model.named_modules())
    for path in ("lm_head", "model.layers.1.mlp.down_proj"):
        assert not isinstance(served[path], QuantLinear)
        torch.testing.assert_close(served[path].weight, ref.get_submodule(path).weight, rtol=0, atol=0)
    assert isinstance(served["model.layers.0.mlp.down_proj"], QuantLinear)
    assert len(_quantized(engine.model)) == 3 * 2 + 1  # qkv, o, gate_up of 2 layers; layer 0's down
    for path, layer in _quantized(engine.model).items():  # exact scales: the same weights, bit for bit
        _assert_within(layer, ref.get_submodule(path).weight, torch.zeros(layer.out_features, layer.in_features))
    _assert_close_to(engine.model, ref, LOGPROB_ATOL)
    dequantized = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64, quantize="none"))
    assert dequantized.quantization is None and not _quantized(dequantized.model)


def test_a_q6_k_only_file_serves_float_and_names_it(tmp_path, make_hf):
    base = resolve_base(_k_file(tmp_path, make_hf, "qwen3", lambda name: GG.Q6_K))
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64))
    assert engine.quantization == "gguf-Q6_K" and not _quantized(engine.model)
    assert served_fingerprint("f" * 32, engine.quantization, allow_float=False).accepts("f" * 32)


@pytest.mark.parametrize("qtype", [GG.Q8_0, GG.Q4_0, GG.Q4_K, GG.Q5_K], ids=lambda q: q.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_block_scale_is_refused_naming_tensor_and_file(qtype, bad, tmp_path, make_hf):
    """At conversion (the first start) and at repacking (a converted directory whose file changed
    since): one line naming the tensor and the file."""
    victim = "blk.1.ffn_up.weight"
    if qtype in (GG.Q8_0, GG.Q4_0):
        source = make_hf("qwen3", **K_SHAPES)
        file = write_gguf(tmp_path / "gguf" / "k.gguf", "qwen3", hf_tensors(source, qtype), hf_meta(source.config))
    else:
        file = _k_file(tmp_path, make_hf, "qwen3", lambda name: qtype)
    base = resolve_base(file)
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors if t.name == victim)
    offset = {GG.Q8_0: 0, GG.Q4_0: 0, GG.Q4_K: 2, GG.Q5_K: 0}[qtype]  # a d, or Q4_K's dmin
    with open(file, "r+b") as f:
        f.seek(int(tensor.data_offset) + offset)
        f.write(np.array([bad], dtype=np.float16).tobytes())
    with pytest.raises(GGUFError) as err:
        repack_gguf(load_model(base), source_file(base), "qwen3")
    text = str(err.value)
    assert "\n" not in text and str(file) in text and f"{victim} has non-finite scales" in text
    with pytest.raises(GGUFError, match=victim.replace(".", r"\.")):
        resolve_base(file)  # the changed file is another file: converted again, and refused


def test_a_k_quant_scale_that_overflows_float16_is_refused(tmp_path, make_hf):
    """d sc beyond float16's range (d 2048, sc up to 63): the product cannot be stored."""
    victim = "blk.0.attn_q.weight"
    file = _k_file(tmp_path, make_hf, "qwen3", lambda name: GG.Q4_K)
    base = resolve_base(file)
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors if t.name == victim)
    with open(file, "r+b") as f:
        f.seek(int(tensor.data_offset))
        f.write(np.array([2048.0], dtype=np.float16).tobytes() + b"\x00\x00" + bytes([0x3F] * 12))
    with pytest.raises(GGUFError, match=rf"{victim.replace('.', '[.]')} has non-finite scales") as err:
        repack_gguf(load_model(base), source_file(base), "qwen3")
    assert str(file) in str(err.value)


# -- AWQ and GPTQ checkpoints --------------------------------------------------------------------
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's "gemm" packing: nibble j holds output AWQ_ORDER[j]
HF_SHAPES = dict(TINY, hidden_size=128, intermediate_size=256, head_dim=32)  # group 128 divides
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(columns: list[np.ndarray]) -> np.ndarray:
    """Eight 4-bit arrays -> int32, the j-th in bits 4j..4j+3."""
    packed = np.zeros(columns[0].shape, np.uint32)
    for j, c in enumerate(columns):
        packed |= (c.astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return packed.view(np.int32)


def pack_awq(q: np.ndarray) -> np.ndarray:
    """[R, C] 4-bit values -> [R, C / 8] int32, along C in AWQ's interleaved order."""
    q = q.reshape(q.shape[0], -1, 8)
    return _int32([q[:, :, AWQ_ORDER[j]] for j in range(8)])


def pack_gptq_rows(q: np.ndarray) -> np.ndarray:
    """[R, C] -> [R / 8, C] int32, along R in order (GPTQ's qweight)."""
    q = q.reshape(-1, 8, q.shape[1])
    return _int32([q[:, j] for j in range(8)])


def pack_gptq_columns(q: np.ndarray) -> np.ndarray:
    """[R, C] -> [R, C / 8] int32, along C in order (GPTQ's qzeros)."""
    q = q.reshape(q.shape[0], -1, 8)
    return _int32([q[:, :, j] for j in range(8)])


def quantized_checkpoint(float_dir: Path, out: Path, method: str, *, group: int = 128, fmt: str = "gptq",
                         g_idx=None, exact: bool = False, **config) -> tuple[Path, Path]:
    """(an AWQ/GPTQ checkpoint, its float twin): random 4-bit codes q, zero points z and float16
    scales s per group for every projection of `float_dir`'s model; the twin holds
    w = s (q - z) as float32. GPTQ's v1 format ("gptq") stores z - 1. `g_idx(K, G)` writes a
    g_idx; `exact` cuts s to 7 significant bits (short_f16)."""
    rng = np.random.default_rng(11)
    tensors = load_file(float_dir / "model.safetensors")
    quantized, twin = {}, {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or prefix.rpartition(".")[2] not in PROJECTIONS:
            quantized[name] = twin[name] = w
            continue
        n, k = w.shape
        g = group if group > 0 else k
        q = rng.integers(0, 16, (k, n))
        z = rng.integers(1, 16, (k // g, n))
        s = (rng.uniform(0.5, 1.5, (k // g, n)) / (4 * k ** 0.5)).astype(np.float16)
        s = short_f16(s, 7) if exact else s  # s z (z < 16) then a float16 value: an exact repack
        rows = np.arange(k) // g
        twin[name] = torch.from_numpy((s[rows].astype(np.float32) * (q - z[rows])).T.copy())
        if method == "awq":
            qweight, qzeros = pack_awq(q), pack_awq(z)
        else:
            qweight, qzeros = pack_gptq_rows(q), pack_gptq_columns(z - 1 if fmt == "gptq" else z)
        quantized.update({f"{prefix}.qweight": torch.from_numpy(qweight), f"{prefix}.qzeros": torch.from_numpy(qzeros),
                          f"{prefix}.scales": torch.from_numpy(s)})
        if g_idx is not None:
            quantized[f"{prefix}.g_idx"] = torch.from_numpy(g_idx(k, g).astype(np.int32))
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq"
              else {"desc_act": g_idx is not None, "sym": False, "checkpoint_format": fmt})
    qc.update(config)
    twin_dir = out.with_name(out.name + "-float")
    for folder, weights in ((out, quantized), (twin_dir, twin)):
        shutil.copytree(float_dir, folder, ignore=shutil.ignore_patterns(MARKER))
        save_file(weights, folder / "model.safetensors")
    cfg = json.loads((float_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return out, twin_dir


@pytest.fixture
def float_base(tmp_path, make_hf):
    """A float base directory of `arch` with a tokenizer (through the GGUF conversion)."""
    from test_gguf import gguf_of

    def make(arch: str = "llama", **shapes) -> Path:
        model = make_hf(arch, **{**HF_SHAPES, **shapes})
        return resolve_base(gguf_of(model, tmp_path / "gguf" / f"{arch}.gguf"))
    return make


def _min_bound(layer: QuantLinear) -> torch.Tensor:
    """The min -s z rounded to float16 (module doc): half a float16 step of it."""
    return (F16_REL * layer.mins.float().abs() + F16_ABS).repeat_interleave(layer.group, dim=1)


@pytest.mark.parametrize("method, fmt, arch", [("awq", None, "llama"), ("gptq", "gptq", "qwen3"),
                                               ("gptq", "gptq_v2", "llama")])
def test_an_awq_or_gptq_checkpoint_is_served_repacked(method, fmt, arch, tmp_path, float_base):
    """Every projection a QuantLinear (int4, group 128) whose weight is the formula's within the
    min's float16 rounding, its product too; with exact mins (module doc), logits of the served
    engine against the float twin within LOGPROB_ATOL; the served fingerprint names the scheme."""
    base = float_base(arch)
    rounded, rounded_twin = quantized_checkpoint(base, tmp_path / "r", method, fmt=fmt or "gptq")
    model, twin = load_model(rounded), load_model(rounded_twin)
    layers = _quantized(model)
    assert len(layers) == 7 * 2 and {(m.bits, m.group) for m in layers.values()} == {(4, 128)}
    for path, layer in layers.items():
        _assert_within(layer, twin.get_submodule(path).weight, _min_bound(layer))
    qdir, twin_dir = quantized_checkpoint(base, tmp_path / "q", method, fmt=fmt or "gptq", exact=True)
    engine = LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    assert engine.quantization == f"{method}-int4-g128"
    twin = load_model(twin_dir)
    twin.fuse_projections()
    _assert_close_to(engine.model, twin, LOGPROB_ATOL)
    served = served_fingerprint(base_fingerprint(qdir), engine.quantization, allow_float=False)
    assert served == base_fingerprint(qdir) + f"+{method}-int4-g128"


def test_quantized_moe_experts_are_served_quantized(tmp_path, float_base):
    """A Qwen3-MoE GPTQ checkpoint whose experts are quantized per expert: each MoE layer's
    experts one QuantExpertLinear of QuantLinears, logits the float twin's within LOGPROB_ATOL."""
    from loraserve.model.quant_moe import QuantExpertLinear

    base = float_base("qwen3_moe", num_experts=4, moe_intermediate_size=128)
    qdir, twin_dir = quantized_checkpoint(base, tmp_path / "q", "gptq", exact=True)
    engine = LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    experts = [m for m in engine.model.modules() if isinstance(m, QuantExpertLinear)]
    assert len(experts) == 3 * 2 and all(m.num_experts == 4 and m.experts[0].group == 128 for m in experts)
    twin = load_model(twin_dir)
    twin.fuse_projections()
    _assert_close_to(engine.model, twin, LOGPROB_ATOL)


def test_a_layer_whose_inputs_the_kernel_cannot_step_is_served_float(tmp_path, float_base):
    """Group 32 on an MLP of 160 (no multiple of the kernel's 64): down_proj is served as its
    dequantized weight, the rest quantized; logits the float twin's (exact mins)."""
    qdir, twin_dir = quantized_checkpoint(float_base("qwen3", intermediate_size=160), tmp_path / "q", "awq",
                                          group=32, exact=True)
    engine = LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    twin = load_model(twin_dir)
    twin.fuse_projections()
    for layer in range(2):
        down = f"model.layers.{layer}.mlp.down_proj"
        assert type(engine.model.get_submodule(down)) is nn.Linear
        torch.testing.assert_close(engine.model.get_submodule(down).weight, twin.get_submodule(down).weight,
                                   rtol=0, atol=0)
    assert len(_quantized(engine.model)) == 3 * 2 and engine.quantization == "awq-int4-g32"
    _assert_close_to(engine.model, twin, LOGPROB_ATOL)


def test_a_per_channel_gptq_checkpoint_takes_group_k(tmp_path, float_base):
    qdir, twin_dir = quantized_checkpoint(float_base("qwen3"), tmp_path / "q", "gptq", group=-1)
    layers = _quantized(load_model(qdir))
    assert {(m.in_features, m.group) for m in layers.values()} == {(128, 128), (256, 256)}
    engine = LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    assert engine.quantization == "gptq-int4-channel"


def test_dequantize_serves_the_same_weights_as_floats_and_quantize_is_refused(tmp_path, float_base):
    qdir, _ = quantized_checkpoint(float_base(), tmp_path / "q", "awq")
    quantized = LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    plain = LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64, quantize="none"))
    assert plain.quantization is None and not _quantized(plain.model)
    for path, layer in _quantized(quantized.model).items():
        torch.testing.assert_close(plain.model.get_submodule(path).weight, layer.dequantized(), rtol=0, atol=0)
    with pytest.raises(QuantError, match="quantized already") as err:
        LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64, quantize="int4"))
    assert "\n" not in str(err.value) and "awq-int4-g128" in str(err.value)


def test_gptq_act_order_is_refused_and_an_in_order_g_idx_serves(tmp_path, float_base):
    """desc_act=True's g_idx (groups of inputs in activation order) is refused naming the file,
    the tensor and desc_act; a g_idx of consecutive groups (desc_act=False's) serves."""
    base = float_base("qwen3")
    in_order, _ = quantized_checkpoint(base, tmp_path / "in-order", "gptq", g_idx=lambda k, g: np.arange(k) // g)
    assert len(_quantized(load_model(in_order))) == 14
    shuffled = lambda k, g: np.random.default_rng(k).permutation(np.arange(k) // g)  # noqa: E731
    act_order, _ = quantized_checkpoint(base, tmp_path / "act-order", "gptq", g_idx=shuffled)
    with pytest.raises(QuantError) as err:
        load_model(act_order)
    text = str(err.value)
    assert "\n" not in text and str(act_order / "model.safetensors") in text
    assert "g_idx" in text and "desc_act=True" in text


@pytest.mark.parametrize("change, fragment", [
    (dict(method="awq", bits=8), "awq bits 8 is not served"),
    (dict(method="gptq", bits=3), "gptq bits 3 is not served"),
    (dict(method="awq", group_size=16), "group_size 16 is not served"),
    (dict(method="awq", version="gemv"), "awq version 'gemv'"),
    (dict(method="gptq", checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(method="awq", quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not served"),
], ids=["awq-bits-8", "gptq-bits-3", "group-16", "awq-gemv", "gptq-marlin", "bitsandbytes"])
def test_an_unsupported_quantization_config_is_refused_naming_it(change, fragment, tmp_path, float_base):
    change = dict(change)
    qdir, _ = quantized_checkpoint(float_base(), tmp_path / "q", change.pop("method"), **change)
    with pytest.raises(QuantError) as err:
        LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    text = str(err.value)
    assert "\n" not in text and str(qdir / "config.json") in text and fragment in text, text


def test_a_group_that_does_not_divide_a_layer_is_refused_naming_it(tmp_path, float_base):
    qdir, _ = quantized_checkpoint(float_base(), tmp_path / "q", "gptq", group=64)
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 96  # the tensors' shapes follow from it: 128 / 96
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantError) as err:
        load_model(qdir)
    text = str(err.value)
    assert "\n" not in text and str(qdir / "model.safetensors") in text
    assert "group_size 96 does not divide its 128 inputs" in text


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_scale_is_refused_naming_the_tensor_and_file(bad, tmp_path, float_base):
    qdir, _ = quantized_checkpoint(float_base(), tmp_path / "q", "awq")
    tensors = load_file(qdir / "model.safetensors")
    victim = "model.layers.1.mlp.up_proj.scales"
    tensors[victim][0, 3] = bad
    save_file(tensors, qdir / "model.safetensors")
    with pytest.raises(QuantError) as err:
        LLMEngine(EngineConfig(model_dir=str(qdir), device="cpu", max_model_len=64))
    text = str(err.value)
    assert "\n" not in text and str(qdir / "model.safetensors") in text and f"{victim} holds non-finite" in text


def test_an_adapter_imported_for_an_awq_base_serves_on_it(tmp_path, float_base):
    """The catalog sees the quantized projections as targetable modules; an adapter imported
    against the AWQ directory is accepted by its served fingerprint (its only weights are the
    quantized ones) and answers as PEFT on the float twin does (each token PEFT's pick, within
    LOGPROB_ATOL of its best; exact mins)."""
    from loraserve.catalog.base import BaseInfo
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import SamplingParams
    from test_quant import _catalog_with, _peft_adapter

    qdir, twin_dir = quantized_checkpoint(float_base(), tmp_path / "q", "awq", exact=True)
    down = BaseInfo.from_dir(qdir).modules["layers.0.mlp.down_proj"]
    assert (down.in_features, down.out_features) == (256, 128)
    peft = _peft_adapter(twin_dir, tmp_path / "peft")
    cat = _catalog_with(tmp_path / "peft", qdir, tmp_path)
    engine = build_engine(EngineConfig(model_dir=str(qdir), catalog_dir=cat, device="cpu", compile="off",
                                       max_model_len=64))
    assert engine.adapters.base_fingerprint == base_fingerprint(qdir) + "+awq-int4-g128"
    prompt = [5, 17, 99, 3, 42, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0), ["acme/a"])[0]
    with torch.no_grad():
        logprobs = peft(torch.tensor([prompt + out])).logits[0].log_softmax(-1)
    for i, token in enumerate(out):
        step = logprobs[len(prompt) - 1 + i]
        assert step.max() - step[token] <= LOGPROB_ATOL, (i, token, int(step.argmax()))
