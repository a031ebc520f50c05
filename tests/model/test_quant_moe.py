"""Quantized routed experts (model/quant_moe.py): `--quantize int8|int4` on a Qwen3-MoE base keeps
every expert quantized, and the model's logits equal the same model with each expert's weight
replaced by its dequantized float weight; a MoE adapter adds its delta beside the quantized
experts as beside float ones."""
from __future__ import annotations

import pytest
import torch

from loraserve.model.moe import ExpertLinear
from loraserve.model.quant import QuantError, QuantLinear, Scheme
from loraserve.model.quant_moe import QuantExpertLinear


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Converted GGUF files in this test's own cache."""
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))


def _experts(e: int = 3, out: int = 48, k: int = 128, seed: int = 0) -> ExpertLinear:
    torch.manual_seed(seed)
    lin = ExpertLinear(e, k, out)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(e, out, k) / k ** 0.5)
    return lin


def _grouped(p: int, e: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, e, (p,), generator=g)).values
    return torch.randn(p, k, generator=g), ids, torch.arange(p)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("pairs", [1, 5, 40])
def test_the_quantized_experts_equal_their_dequantized_weights(scheme, pairs) -> None:
    lin = _experts()
    q = QuantExpertLinear.of(lin, Scheme.parse(scheme, None))
    assert all(isinstance(m, QuantLinear) for m in q.experts) and q.num_experts == 3
    x, ids, tok = _grouped(pairs, 3, 128)
    reference = ExpertLinear(3, 128, 48)
    with torch.no_grad():
        reference.weight.copy_(q.weight)  # the dequantized [E, out, in]
    torch.testing.assert_close(q(x, ids, tok), reference(x, ids, tok), rtol=1e-4, atol=1e-4)
    # and near the float weights (the scheme's own rounding)
    err = (q(x, ids, tok) - lin(x, ids, tok)).abs().max() / lin(x, ids, tok).abs().max()
    assert err < (0.02 if scheme == "int8" else 0.2)


def test_rows_out_of_order_or_out_of_range_are_refused_as_for_float_experts() -> None:
    q = QuantExpertLinear.of(_experts(), Scheme.parse("int4", None))
    x = torch.randn(3, 128)
    with pytest.raises(ValueError, match="grouped by expert"):
        q(x, torch.tensor([2, 0, 1]), torch.arange(3))
    with pytest.raises(ValueError, match="grouped by expert"):
        q(x, torch.tensor([0, 1, 7]), torch.arange(3))


def test_experts_of_different_shapes_or_none_are_refused() -> None:
    a = QuantExpertLinear.of(_experts(out=48), Scheme.parse("int8", None)).experts[0]
    b = QuantExpertLinear.of(_experts(out=64), Scheme.parse("int8", None)).experts[0]
    with pytest.raises(QuantError, match="single shape"):
        QuantExpertLinear([a, b])
    with pytest.raises(QuantError, match="single shape"):
        QuantExpertLinear([])


@pytest.mark.parametrize("setting", ["int8", "int4"])
def test_quantize_flag_quantizes_every_expert_of_a_moe_base(setting, tmp_path, make_hf) -> None:
    """`--quantize` on a Qwen3-MoE directory: the attention linears and every expert quantized
    (the router stays float: it picks experts), logits within test_quant's tolerance of the same
    model over the dequantized weights, one row (the kernel) and prefill."""
    import copy

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.llm_engine import LLMEngine
    from loraserve.model.gguf import resolve_base
    from test_gguf import TINY, gguf_of
    from test_quant import _assert_close_to, _dequantized_twin

    # a float base with a tokenizer (as test_quant makes one); 64 inputs to every expert
    # projection, the kernels' multiple
    hf = make_hf("qwen3_moe", **TINY, moe_intermediate_size=64)
    base = resolve_base(gguf_of(hf, tmp_path / "gguf" / "f32.gguf"))
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64, quantize=setting))
    experts = [m for m in engine.model.modules() if isinstance(m, QuantExpertLinear)]
    assert len(experts) == 2 * 3  # 2 layers x gate, up, down
    assert all(q.num_experts == 6 for q in experts)
    assert not any(type(m) is ExpertLinear for m in engine.model.modules())
    _assert_close_to(engine.model, _dequantized_twin(copy.deepcopy(engine.model)))
    routers = [m.gate for m in engine.model.modules() if type(m).__name__ == "SparseMoeBlock"]
    assert len(routers) == 2 and all(type(r) is torch.nn.Linear for r in routers)  # float: it picks experts


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_quantized_moe_gguf_serves_its_experts_repacked(qtype, tmp_path, make_hf) -> None:
    """Default flags on a Qwen3-MoE GGUF whose expert tensors are quantized: each expert's plane
    of the file's blocks becomes a QuantLinear holding exactly the dequantized directory's
    weights; logits within test_quant's tolerance of the dequantized model."""
    from gguf import GGMLQuantizationType as GG

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.llm_engine import LLMEngine
    from loraserve.model import load_model
    from loraserve.model.gguf import resolve_base
    from test_gguf import TINY, gguf_of
    from test_quant import _assert_close_to

    hf = make_hf("qwen3_moe", **TINY, moe_intermediate_size=64)
    base = resolve_base(gguf_of(hf, tmp_path / "gguf" / "moe.gguf", GG[qtype]))
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", max_model_len=64))
    assert engine.quantization == f"gguf-{qtype}"
    ref = load_model(base)
    ref.fuse_projections()
    experts = {n: m for n, m in engine.model.named_modules() if isinstance(m, QuantExpertLinear)}
    assert len(experts) == 2 * 3
    plain = dict(ref.named_modules())
    for name, layer in experts.items():
        torch.testing.assert_close(layer.weight, plain[name].weight, rtol=0, atol=0, msg=name)
    _assert_close_to(engine.model, ref)


@pytest.mark.parametrize("seed", range(4))
def test_a_non_finite_scale_in_any_expert_plane_is_refused_naming_the_tensor(seed, tmp_path, make_hf) -> None:
    """A damaged block anywhere in a packed expert tensor (a seeded draw of tensor, expert and
    block, the last plane included) refuses the file at load, naming the tensor and the file,
    as for a dense tensor (test_quant)."""
    import random
    import re

    import gguf
    import numpy as np

    from loraserve.model import load_model
    from loraserve.model.gguf import GGUFError, resolve_base
    from loraserve.model.quant_gguf import repack_gguf, source_file
    from test_gguf import TINY, gguf_of

    file = gguf_of(make_hf("qwen3_moe", **TINY, moe_intermediate_size=64), tmp_path / "moe.gguf",
                   gguf.GGMLQuantizationType.Q4_1)
    base = resolve_base(file)  # converted while the file was sound
    rng = random.Random(seed)
    tensors = [t for t in gguf.GGUFReader(str(file)).tensors if t.name.endswith("_exps.weight")]
    tensor = rng.choice(tensors)
    experts, blocks = int(tensor.shape[-1]), int(tensor.n_bytes) // 20  # Q4_1: 20 bytes a block
    expert = experts - 1 if seed == 0 else rng.randrange(experts)
    block = expert * (blocks // experts) + rng.randrange(blocks // experts)
    with open(file, "r+b") as f:
        f.seek(int(tensor.data_offset) + 20 * block + rng.choice([0, 2]))  # its scale or its min
        f.write(np.array([rng.choice([np.inf, -np.inf, np.nan])], dtype=np.float16).tobytes())
    with pytest.raises(GGUFError, match=re.escape(tensor.name) + " has non-finite") as err:
        repack_gguf(load_model(base), source_file(base), "qwen3_moe")
    assert str(file) in str(err.value)
