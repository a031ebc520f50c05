"""q/k/v and gate/up fused into one GEMM each (`CausalLM.fuse_projections`): the same model as
transformers', plain or packed, and a projection's slice still takes a hook's delta and its gradient."""
from __future__ import annotations

import pytest
import torch

from loraserve.model import load_model
from loraserve.model.layers import FusedSlice
from loraserve.model.prepack import PackedLinear, prepack_linears
from loraserve.train.hooks import _packed_hook

VOCAB = 96  # tests/model/conftest.py
CASES = {
    "qwen3": dict(arch="qwen3"),
    "llama-biases": dict(arch="llama", attention_bias=True, mlp_bias=True, head_dim=None),
    "qwen2-qkv-bias": dict(arch="qwen2", head_dim=None),
    "moe-mixed-layers": dict(arch="qwen3_moe", num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[2]),
}


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).log_softmax(-1)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_model_matches_transformers(case, packed, tmp_path, make_hf):
    spec = dict(CASES[case])
    ref = make_hf(spec.pop("arch"), **spec)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    dense_mlps = sum(not hasattr(layer.mlp, "experts") for layer in ours.model.layers)
    assert ours.fuse_projections() == len(ours.model.layers) + dense_mlps
    assert ours.fuse_projections() == 0  # done once
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedSlice) and attn.q_proj.out_features == ref.config.num_attention_heads * (
        attn.head_dim) and attn.qkv_proj.out_features == attn.head_dim * (attn.num_heads + 2 * attn.num_kv_heads)
    if packed:
        prepack_linears(ours, batch_hint=8)
        assert isinstance(attn.qkv_proj, PackedLinear)
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float().log_softmax(-1)
    assert (_logprobs(ours, ids) - want).abs().max().item() <= 1e-4


def test_a_hook_on_a_fused_slice_adds_its_delta_and_gets_its_gradient(hf_dense_dir):
    """What the training hooks rely on: a forward hook at `self_attn.k_proj` / `mlp.up_proj` sees
    x and that projection's output, returns output + delta, and the delta's parameter gets the
    same gradient as on the unfused model (packed too: the fused GEMM passes the gradient on)."""
    results = []
    for fuse in (False, True):
        model = load_model(hf_dense_dir)
        if fuse:
            model.fuse_projections()
            prepack_linears(model, batch_hint=8)
            for m in model.modules():
                if isinstance(m, PackedLinear):
                    m.register_forward_hook(_packed_hook)  # a packed GEMM's input gradient
        layer = model.model.layers[1]
        gains = [torch.zeros(p.out_features, requires_grad=True) for p in (layer.self_attn.k_proj, layer.mlp.up_proj)]
        for proj, gain in zip((layer.self_attn.k_proj, layer.mlp.up_proj), gains):
            proj.register_forward_hook(lambda mod, args, out, g=gain: out + args[0][:, :1] * g)
        ids = torch.arange(12) % VOCAB
        emb = model.model.embed_tokens(ids).detach().requires_grad_(True)  # a packed GEMM wants x to need grad
        model.model.embed_tokens.forward = lambda _ids, e=emb: e
        loss = model.compute_logits(model(ids, torch.arange(12))).log_softmax(-1)[:, 3].sum()
        loss.backward()
        results.append((loss.detach(), [g.grad for g in gains]))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.allclose(loss0, loss1, rtol=1e-5)
    for g0, g1 in zip(grads0, grads1):
        assert g0.abs().sum() > 0 and torch.allclose(g0, g1, rtol=1e-4, atol=1e-5)


def test_q_and_k_rotated_together_equal_apart(hf_dense_dir, monkeypatch):
    """A fused Qwen3 normalises and rotates q and k as one tensor (`Attention._qk_together`):
    bit-for-bit what the separate per-projection norms and rotations give, in inference mode
    (the serving path), over a prompt and at one row (a decode step)."""
    from loraserve.model import layers
    model = load_model(hf_dense_dir)
    model.fuse_projections()
    attn = model.model.layers[0].self_attn
    assert attn.qk_norm_weight.shape == (attn.num_heads + attn.num_kv_heads, attn.head_dim)
    calls = []
    real = layers.Attention._qk_together
    monkeypatch.setattr(layers.Attention, "_qk_together", lambda *a: calls.append(1) or real(*a))
    for n in (16, 1):
        ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            together = model(ids, torch.arange(n))
            with monkeypatch.context() as m:
                m.setattr(layers, "_in_place", lambda *a: False)  # as if a hook replaced q or k
                apart = model(ids, torch.arange(n))
        assert len(calls) == len(model.model.layers)  # the first run only
        assert torch.equal(together, apart)
        calls.clear()


def test_decode_fast_paths_equal_the_sliced_path_and_honour_hooks(hf_llama, monkeypatch):
    """An eager CPU decode step reads the fused q/k/v and gate/up outputs whole
    (`PagedAttention.fused_qkv`, `cpu_fused.silu_mul_halves`): the hidden states equal the
    sliced path's (q, k, v and gate, up taken apart, then rope, attention, silu_mul), and a hook
    that returns a new tensor at `k_proj` / `up_proj` (not the fused output's columns in place)
    is honoured on both."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.attention import PagedAttention
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import GenerateRequest, SamplingParams
    from loraserve.kernels import cpu_fused

    eng = build_engine(EngineConfig(model_dir=str(hf_llama), max_model_len=64, compile="off",
                                    prefix_caching=False, max_batch_size=4))
    model = eng.runner.model
    assert model.model.layers[0].self_attn.qkv_proj is not None and model.model.layers[0].mlp.gate_up_proj is not None
    hidden: list[torch.Tensor] = []
    real_logits = type(model).compute_logits
    monkeypatch.setattr(type(model), "compute_logits", lambda self, h: hidden.append(h.clone()) or real_logits(self, h))
    fused_calls: list[int] = []
    real_fused, real_layers = cpu_fused.qkv_attention, cpu_fused.decode_layers
    monkeypatch.setattr(cpu_fused, "qkv_attention", lambda *a: fused_calls.append(1) or real_fused(*a))
    # the decode plan's loop in C++ calls the same op from there (model.decode_plan)
    monkeypatch.setattr(cpu_fused, "decode_layers", lambda *a: fused_calls.append(1) or real_layers(*a))

    def run(tag: str) -> list[torch.Tensor]:
        hidden.clear()
        eng.add_request(GenerateRequest(tag, [3, 14, 15, 9, 2, 6], SamplingParams(
            max_tokens=5, temperature=0.0, ignore_eos=True)))
        while eng.has_work():
            eng.step()
        return list(hidden)

    def both_paths(tag: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        fused_calls.clear()
        fast = run(tag + "-fast")
        assert fused_calls, "the decode steps did not take the fused q/k/v path"
        with monkeypatch.context() as m:
            m.setattr(PagedAttention, "fused_qkv", None)
            m.setattr(PagedAttention, "qkv_decoder", None)  # and the whole-step plan (model.decode_plan)
            fused_calls.clear()
            sliced = run(tag + "-sliced")
            assert not fused_calls
        for a, b in zip(fast, sliced, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return fast, sliced

    plain, _ = both_paths("plain")
    layer = model.model.layers[1]
    handles = [p.register_forward_hook(lambda mod, args, out: out + 0.25)
               for p in (layer.self_attn.k_proj, layer.mlp.up_proj)]
    try:
        hooked, _ = both_paths("hooked")
    finally:
        for h in handles:
            h.remove()
    assert not torch.allclose(hooked[-1], plain[-1], atol=1e-3)  # the hooks changed the decode steps
    # A hook that adds in place to the fused output's columns (as the serving LoRA wrapper does),
    # on q/v and gate: called once on every path, its delta counted once (prefill included).
    handles = [p.register_forward_hook(lambda mod, args, out: out.add_(0.25))
               for p in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.gate_proj)]
    try:
        in_place, _ = both_paths("in-place")
    finally:
        for h in handles:
            h.remove()
    assert not torch.allclose(in_place[0], plain[0], atol=1e-3)
