"""Base weights packed for oneDNN (loraserve.model.prepack) give what `F.linear` gives, to float32
rounding: the module alone, a whole model against transformers, and the engine with and without."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.model import load_model
from loraserve.kernels import cpu_gemv
from loraserve.model.prepack import (DEFAULT_LLC_BYTES, PER_CPU_CACHE_BYTES, PLAIN_MAX_BATCH, PackedLinear,
                                     VectorLinear, bf16_kernels, cache_share_bytes, can_prepack, last_level_cache_bytes, linear_weight_bytes,
                                     outgrows_last_level_cache, prepack_linears, unpack_linears,
                                     vector_linears, weight_layout)


def test_prepack_applies_to_float32_and_native_bfloat16_on_the_cpu_only():
    assert can_prepack(torch.device("cpu"), torch.float32)  # the pinned torch has oneDNN
    assert can_prepack(torch.device("cpu"), torch.bfloat16) == bf16_kernels()
    assert not can_prepack(torch.device("cpu"), torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_for_any_row_count(bias):
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(plain, batch_hint=32)
    for rows in (1, 7, 32, 100):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(packed(x), F.linear(x, plain.weight, plain.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 5, 48)  # leading axes pass through
    torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(48, 6).t()  # a non-contiguous input
    torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, plain.weight.detach())  # unpacking is exact
    assert packed.in_features == 48 and packed.out_features == 80


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_linear_equals_f_linear_with_its_dtypes_layout(bias, dtype):
    """`vector_linears` swaps the class; a float32 weight is copied column-major (its one-row
    GEMM streams it fastest) unless `cpu_gemv` reads float32 rows here (then it stays row-major,
    the layout of that kernel), a bfloat16 one stays row-major (one row as torch.mv). The shape
    stays [out, in] and the values are the same; any row count gives F.linear's result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80, bias=bias), nn.ReLU(), nn.Linear(80, 8, bias=bias)).to(dtype)
    ref = [(m.weight.detach().clone(), m.bias) for m in (model[0], model[2])]
    xs = [torch.randn(1, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype), torch.randn(2, 3, 48, dtype=dtype)]
    want = [model(x) for x in xs]
    assert vector_linears(model) == 2 and vector_linears(model) == 0
    assert all(type(m) is VectorLinear for m in (model[0], model[2]))
    for m, (w, b) in zip((model[0], model[2]), ref):
        assert torch.equal(m.weight, w) and m.bias is b and m.weight.shape == w.shape
        column = dtype == torch.float32 and not cpu_gemv.reads_rows_once(dtype)
        assert m.weight.is_contiguous() == (not column)
        assert m.weight.t().is_contiguous() == column
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for x, y in zip(xs, want):
        torch.testing.assert_close(model(x), y, rtol=tol, atol=tol)


def test_vector_linears_keeps_a_tied_head_on_its_embedding():
    """A weight another module shares (a tied head) keeps its layout: the embedding reads it."""
    emb, head = nn.Embedding(32, 16), nn.Linear(16, 32, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "mlp": nn.Linear(16, 16)})
    vector_linears(model)
    assert model["head"].weight is emb.weight and emb.weight.is_contiguous()
    assert model["mlp"].weight.t().is_contiguous() != cpu_gemv.reads_rows_once(torch.float32)
    x = torch.randn(1, 16)
    torch.testing.assert_close(model["head"](x), x @ emb.weight.t(), rtol=1e-5, atol=1e-5)


def test_weight_layout_packs_a_big_base_that_can_batch():
    cpu, f32 = torch.device("cpu"), torch.float32
    model = nn.Sequential(nn.Linear(64, 64))
    size = linear_weight_bytes(model)
    big, small = size - 1, size  # last-level cache bytes: outgrown, not outgrown
    # where cpu_gemv reads a plain float32 weight once for a few rows, plain serves every batch
    batching = "plain" if cpu_gemv.reads_rows_once(f32) else "packed"
    assert weight_layout("auto", model, cpu, f32, 64, cache_bytes=big) == batching
    assert weight_layout("auto", model, cpu, f32, PLAIN_MAX_BATCH, cache_bytes=big) == "plain"
    assert weight_layout("auto", model, cpu, f32, 64, cache_bytes=small) == "plain"
    assert weight_layout("on", model, cpu, f32, 1, cache_bytes=small) == "packed"
    assert weight_layout("off", model, cpu, f32, 64, cache_bytes=big) == "plain"
    assert weight_layout("on", model, torch.device("cuda"), f32, 64) == "plain"
    vector_linears(model)
    assert linear_weight_bytes(model) == size  # still counted as plain weights


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_packed_model_matches_transformers(arch, tie, tmp_path, make_hf):
    ref = make_hf(arch, tie=tie)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    n_linear = sum(type(m) is nn.Linear for m in ours.modules())
    embedding = ours.model.embed_tokens.weight
    before = embedding.detach().clone(), embedding.data_ptr()
    assert prepack_linears(ours, batch_hint=8) == n_linear > 0
    # the tensors left plain now own their memory (the checkpoint's mapping can go), same values
    assert ours.model.embed_tokens.weight is embedding and embedding.data_ptr() != before[1]
    assert torch.equal(embedding, before[0])
    assert not any(type(m) is nn.Linear for m in ours.modules())
    if tie:  # the embedding keeps its own plain weight; the head is a packed copy of it
        assert torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)

    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lp = ours.compute_logits(ours(ids, torch.arange(len(ids)))).log_softmax(-1)
        lp_hf = ref(ids[None]).logits[0].float().log_softmax(-1)
    assert (lp - lp_hf).abs().max().item() <= 1e-4
    assert torch.equal(lp.argmax(-1), lp_hf.argmax(-1))

    assert unpack_linears(ours) == n_linear  # back to plain modules with the same weights
    assert not any(isinstance(m, PackedLinear) for m in ours.modules())
    with torch.no_grad():
        again = ours.compute_logits(ours(ids, torch.arange(len(ids)))).log_softmax(-1)
    assert (again - lp_hf).abs().max().item() <= 1e-4


def test_bfloat16_model_matches_transformers_at_bfloat16_tolerance(tmp_path, make_hf):
    """--dtype bfloat16 on the CPU: packed where oneDNN has bfloat16 kernels (this CPU: AVX512-BF16
    and AMX), plain otherwise; either way transformers' bfloat16 logprobs within bfloat16's
    rounding, and the same greedy token nearly everywhere (a near-tie may flip)."""
    ref = make_hf("qwen3")
    ref.save_pretrained(tmp_path)
    ref = ref.to(torch.bfloat16)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    if can_prepack(torch.device("cpu"), torch.bfloat16):
        assert prepack_linears(ours, batch_hint=8) > 0
        assert all(m.packed.dtype == torch.bfloat16 for m in ours.modules() if isinstance(m, PackedLinear))
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lp = ours.compute_logits(ours(ids, torch.arange(len(ids)))).log_softmax(-1)
        lp_hf = ref(ids[None]).logits[0].float().log_softmax(-1)
    assert lp.dtype == torch.float32
    assert (lp - lp_hf).abs().max().item() <= 0.15
    assert (lp.argmax(-1) == lp_hf.argmax(-1)).float().mean().item() >= 0.9


def test_auto_packs_a_base_whose_linear_weights_outgrow_the_last_level_cache(tmp_path, make_hf):
    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "1024K"), (3, "Unified", "32768K")]):
        d = tmp_path / "cache" / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path / "cache") == 32 * 2**20
    assert last_level_cache_bytes(tmp_path / "none") == DEFAULT_LLC_BYTES
    model = make_hf("qwen3").eval()
    ours_dir = tmp_path / "m"
    model.save_pretrained(ours_dir)
    ours = load_model(ours_dir)
    size = linear_weight_bytes(ours)
    assert size == sum(m.weight.numel() * 4 for m in ours.modules() if type(m) is nn.Linear) > 0
    assert outgrows_last_level_cache(ours, cache_bytes=size - 1) and not outgrows_last_level_cache(ours, cache_bytes=size)


def test_a_process_counts_on_its_share_of_a_large_shared_cache():
    """A 2-vCPU guest of a 300 MiB-L3 host counts on 16 MiB, not the socket's whole cache; a
    bare-metal cache below the per-CPU share counts whole."""
    assert cache_share_bytes(llc=300 * 2**20, cpus=2) == 2 * PER_CPU_CACHE_BYTES == 16 * 2**20
    assert cache_share_bytes(llc=32 * 2**20, cpus=8) == 32 * 2**20
    assert cache_share_bytes(llc=32 * 2**20, cpus=1) == PER_CPU_CACHE_BYTES


def test_default_threads_follow_the_same_rule(monkeypatch):
    from loraserve.engine.core.llm_engine import default_torch_threads, usable_cpus
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mask = len(os.sched_getaffinity(0))
    assert usable_cpus() == mask
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray sets for a 1-CPU replica
    assert usable_cpus() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "999")
    assert usable_cpus() == mask
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert usable_cpus() == mask
    assert default_torch_threads(True, 2) == 2 and default_torch_threads(True, 16) == 16
    assert default_torch_threads(False, 2) == 1 and default_torch_threads(False, 16) == 15
    assert default_torch_threads(False, 1) == 1


def test_engine_packed_gives_the_unpacked_tokens(demo_dense):
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.llm_engine import LLMEngine
    from loraserve.engine.types import GenerateRequest, SamplingParams

    def run(prepack: str):
        eng = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                     max_model_len=128, weight_prepack=prepack))
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, eng.vocab_size - 3, (n,), generator=g).tolist() for n in (5, 19, 2, 33)]
        seqs = [eng.add_request(GenerateRequest(f"r{i}", p, params)) for i, p in enumerate(prompts)]
        while eng.has_work():
            eng.step()
        layer = eng.model.model.layers[0].mlp.down_proj
        return layer, [(s.output_ids, [t.logprob for t in s.output_logprobs]) for s in seqs]

    packed, got = run("on")
    plain, want = run("off")
    assert isinstance(packed, PackedLinear) and type(plain) is nn.Linear
    for (ids, lps), (ids_ref, lps_ref) in zip(got, want):
        assert ids == ids_ref
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps_ref), rtol=0, atol=1e-5)
    auto, _ = run("auto")  # the demo base fits in any last-level cache: packing would not pay
    assert type(auto) is nn.Linear
    with pytest.raises(ValueError, match="weight_prepack must be"):
        EngineConfig(model_dir="x", weight_prepack="yes")
