"""Training on a quantized base (QLoRA): forward and backward through `QuantLinear`
(model/quant.py), gradients to the LoRA factors only, and the adapter it makes served on the
same quantized base with the logits training saw.

Tolerances, stated once: the layer's input gradient equals float64 autograd through the
dequantized weight to float32 rounding (1e-5); a pass's factor gradients equal those over a
float twin holding the dequantized weights (GRAD_RTOL: the kernel's and the GEMM's float sums
differ in order only), on every path a pass takes (one batch, several slices, chunks of a long
datum); training's logprobs equal the served prompt logprobs with the saved adapter within
SERVE_ATOL (the serving LoRA kernels sum in another order than training's products).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.adapters.limits import check_base
from loraserve.catalog.base import base_fingerprint, served_fingerprint, trained_fingerprint
from loraserve.catalog.errors import BaseMismatch
from loraserve.catalog.format import read_adapter_meta
from loraserve.catalog.store import Catalog
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.engine.core.training import trainer_of
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.model import quant, quant_load
from loraserve.model.quant import KERNELS, QuantLinear, Scheme, quant_linear_of, unpack_codes
from loraserve.model.tiny import random_model, tiny_config, write_tokenizer_files
from loraserve.model.writer import save_checkpoint
from loraserve.train.config import RunConfig
from loraserve.train.run import AdamParams, Datum, TrainingRun

GRAD_RTOL, SERVE_ATOL = 1e-4, 1e-5
RUN = {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}
SCHEMES = [Scheme(8, 0), Scheme(4, 32), Scheme(4, 64)]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny shapes: one intra-op thread (conftest's one_torch_thread)."""


def _reference_weight(layer: QuantLinear) -> torch.Tensor:
    """w = scale * q + min in float64, from the codes (independent of the layer's dequantize)."""
    n, k, g = layer.out_features, layer.in_features, layer.group
    q = unpack_codes(layer.codes, layer.bits, k).double().view(n, k // g, g)
    return (q * layer.scales.double()[..., None] + layer.mins.double()[..., None]).view(n, k)


# -- the layer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [3, KERNELS["int4"] + 4])  # the kernel, prefill's GEMM
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_the_input_gradient_is_float64_autograd_through_the_dequantized_weight(scheme, rows, monkeypatch):
    """dx = dy W with W dequantized in slices of 40 output rows (136 rows: 4 slices, the last
    ragged), no slice larger than BACKWARD_SLICE_BYTES; no gradient to codes, scales, mins."""
    monkeypatch.setattr(quant, "BACKWARD_SLICE_BYTES", 40 * 128 * 4)
    torch.manual_seed(rows)
    layer = quant_linear_of(nn.Linear(128, 136), scheme)
    slices = []
    dequantize = layer.dequantized_rows
    monkeypatch.setattr(layer, "dequantized_rows", lambda s, e, dtype: slices.append((s, e)) or dequantize(s, e, dtype))
    x, dy = torch.randn(rows, 128), torch.randn(rows, 136)
    xq = x.clone().requires_grad_()
    y = layer(xq)
    slices.clear()  # the forward's own dequantize (prefill's GEMM) is not the backward's
    y.backward(dy)
    x64 = x.double().requires_grad_()
    ref = F.linear(x64, _reference_weight(layer), layer.bias.double())
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xq.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    assert slices == [(0, 40), (40, 80), (80, 120), (120, 136)]
    assert not any(t.requires_grad for t in (*layer.parameters(), *layer.buffers()))


@pytest.mark.parametrize("rows", [3, KERNELS["int4"] + 4])
def test_a_bfloat16_input_gradient_sums_its_slices_in_float32(rows, monkeypatch):
    """A bf16 base's backward: slices summed in float32, rounded to bf16 once: within 2^-8 of
    max |dx| (here 0.002 of it; summed in bf16 slice by slice it was 0.005-0.007)."""
    monkeypatch.setattr(quant, "BACKWARD_SLICE_BYTES", 16 * 128 * 4)  # 9 slices of 16 rows
    torch.manual_seed(rows)
    layer = quant_linear_of(nn.Linear(128, 136, bias=False), Scheme(4, 64))
    x = torch.randn(rows, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, 136, dtype=torch.bfloat16)
    layer(x).backward(dy)
    want = dy.double() @ _reference_weight(layer)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), want, rtol=0, atol=2 ** -8 * float(want.abs().max()))


def test_gradcheck_in_float64():
    """torch's numerical gradient check on prefill's path (float64 rows, the GEMM)."""
    torch.manual_seed(0)
    layer = quant_linear_of(nn.Linear(64, 40, bias=False), Scheme(4, 32))  # a float32 bias: float32 rows only
    x = torch.randn(KERNELS["int4"] + 1, 64, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,), fast_mode=True)


def test_the_forward_keeps_no_float_weight_for_backward():
    """Nothing is saved for backward (the old path kept each layer's dequantized weight until
    the backward: a float copy of the whole base during a training forward)."""
    layer = quant_linear_of(nn.Linear(256, 192), Scheme(4, 64))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        ys = [layer(torch.randn(rows, 256, requires_grad=True)) for rows in (2, 40)]
    assert saved == [] and all(y.grad_fn is not None for y in ys)


# -- the trainer on a quantized base ---------------------------------------------------------------
def _quantized(model: nn.Module) -> nn.Module:
    """`--quantize int4` as the engine applies it: every nn.Linear quantized, then fused."""
    assert quant_load.apply(model, "unused", "int4", None, "float32") == "int4-g64"
    model.fuse_projections()
    return model


def _dequantized_twin(model: nn.Module) -> nn.Module:
    """The float model `model` was quantized from (seed 0), each of its linears (and experts,
    where an expert stack holds one QuantLinear per expert) holding the weight its QuantLinear
    dequantizes to."""
    twin = random_model(model.config, seed=0)
    twin.fuse_projections()
    plain = dict(twin.named_modules())
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, QuantLinear):
                continue
            if name in plain:
                plain[name].weight.copy_(layer.dequantized())
            else:  # `<stack>.experts.<e>`: expert e of a float ExpertLinear in the twin
                stack, _, e = name.rpartition(".experts.")
                plain[stack].weight[int(e)].copy_(layer.dequantized())
    return twin


BASES = {"dense": dict(arch="qwen3", num_layers=2),
         "moe": dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_experts=4, moe_intermediate_size=32)}


@pytest.fixture(scope="module", params=list(BASES))
def qbase(request) -> nn.Module:
    return _quantized(random_model(tiny_config(**BASES[request.param]), seed=0))


def _data(lengths=(5, KERNELS["int4"] + 4, 12)) -> list[Datum]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        toks = torch.randint(0, 259, (n + 1,), generator=g)
        out.append(Datum(toks[:-1].clone(), {"target_tokens": toks[1:].clone(), "weights": torch.rand(n, generator=g)}))
    return out


def _grads(model: nn.Module, budget: int) -> tuple[list[torch.Tensor], float]:
    """One cross_entropy forward_backward in slices of `budget` tokens: the factor gradients
    and the loss. Factors drawn at random (B is zero at init, which zeroes A's gradient)."""
    run = TrainingRun(model, RunConfig(**RUN))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in run.factors.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    p = run.start(_data(), "cross_entropy")
    while not p.advance(budget):
        pass
    loss = p.finish().metrics["loss:sum"]
    return run.grads, loss


def test_factor_gradients_equal_the_dequantized_twins_on_every_path(qbase):
    """Budgets: everything in one batch (53 rows, the GEMM), one datum a slice (5 and 12 rows
    through the kernel, 36 through the GEMM), and chunks of 9 (the long datums' chunked
    forward and checkpointed backward). MoE: the MoE block holds quantized layers (the
    router, or the experts: whatever `--quantize` quantizes there) and trains through them."""
    if qbase.config.num_experts:
        assert any(isinstance(m, QuantLinear) for m in qbase.model.layers[0].mlp.modules())
    want, want_loss = _grads(_dequantized_twin(qbase), 10_000)
    for budget in (10_000, KERNELS["int4"] + 4, 9):
        got, loss = _grads(qbase, budget)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(b.abs().max()))


def test_steps_change_the_factors_only(qbase):
    """forward_backward + optim_step lowers the loss and leaves every byte of the base as it was."""
    before = {k: v.clone() for k, v in qbase.state_dict().items()}
    assert any(k.endswith(".codes") for k in before)
    run = TrainingRun(qbase, RunConfig(**RUN))
    losses = []
    for _ in range(4):
        p = run.start(_data(), "cross_entropy")
        while not p.advance(20):
            pass
        losses.append(p.finish().metrics["loss:sum"])
        run.optim_step(AdamParams(**ADAM))
    assert losses[-1] < losses[0]
    after = qbase.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert v.dtype == after[k].dtype and torch.equal(v.view(torch.uint8), after[k].view(torch.uint8)), k
    assert all(float(b.detach().abs().max()) > 0 for _, b in run.factors.pairs.values())


# -- train to serve ------------------------------------------------------------------------------
def _served_logprobs(engine, tokens: list[int], adapter: str | None) -> list[float]:
    seq = engine.add_request(GenerateRequest(f"g{len(engine.seqs)}-{adapter}-{len(tokens)}", tokens, SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0), adapter=adapter))
    while engine.has_work():
        engine.step()
    return [lp.logprob for lp in seq.prompt_logprobs[1:]]


@pytest.fixture(params=["dense", "moe"])
def base_dir(request, demo_dense, tmp_path):
    """The demo's dense base, or a small MoE base (experts of 64 inputs, so all quantizable)."""
    if request.param == "dense":
        return demo_dense
    base = tmp_path / "moe"
    save_checkpoint(random_model(tiny_config(**{**BASES["moe"], "moe_intermediate_size": 64}), seed=0), base)
    write_tokenizer_files(base)
    return base


def test_the_adapter_serves_on_the_quantized_base_with_the_logits_training_saw(base_dir, tmp_path):
    """Trained through the engine core on `--quantize int4`; saved, it carries the quantized
    base's fingerprint, serves there without --allow-quantized-base-adapters, and scores each
    datum's tokens as the run's forward did (a 10-token datum through the kernel, one of
    KERNELS + 8 tokens through the GEMM, on both sides); the float base refuses it (409)."""
    Catalog.create(tmp_path / "catalog", shards=1).close()
    engine = build_engine(EngineConfig(model_dir=str(base_dir), catalog_dir=str(tmp_path / "catalog"),
                                       device="cpu", dtype="float32", compile="off",
                                       max_model_len=KERNELS["int4"] + 64, torch_threads=1, quantize="int4"))
    core = trainer_of(engine)
    core.create("q", RUN)
    data = []
    for i, n in enumerate((10, KERNELS["int4"] + 8)):
        toks = [(7 * j + 3 * i) % 250 + 1 for j in range(n + 1)]
        data.append([toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * n}])
    losses = []
    for step in range(3):
        core.begin("q", f"p{step}", data, "cross_entropy", None, True, "default", 1.0)
        while (result := core.advance(f"p{step}", 64)) is None:
            pass
        losses.append(result["metrics"]["loss:sum"])
        core.optim_step("q", ADAM)
    assert losses[-1] < losses[0]
    blob = core.publish("q", "test", "default/q", "s1")
    fingerprint = read_adapter_meta(blob, "q")["base_fingerprint"]
    assert fingerprint == base_fingerprint(base_dir) + "+int4-g64"
    engine.adapters.catalog.put_revision("default/q", blob, revision="s1", promote=True, source="test")
    for i, (tokens, inputs) in enumerate(data):
        core.begin("q", f"f{i}", [[tokens, inputs]], "cross_entropy", None, False, "default", 1.0)
        while (result := core.advance(f"f{i}", 64)) is None:  # a long datum takes several slices
            pass
        trained = result["outputs"][0]["logprobs"]
        full = tokens + [inputs["target_tokens"][-1]]
        served = _served_logprobs(engine, full, "default/q@s1")
        assert served == pytest.approx(trained, abs=SERVE_ATOL)
        base = _served_logprobs(engine, full, None)
        assert max(abs(a - b) for a, b in zip(base, trained)) > 1e-3  # it learned
    with pytest.raises(BaseMismatch) as err:
        check_base("default/q@s1", fingerprint, base_fingerprint(base_dir))
    assert err.value.status == 409


def test_a_revision_records_the_base_it_trained_on():
    """An int8/int4 base's own fingerprint (whether or not it takes float adapters); a GGUF
    repack's float one (its weights are the float base's, which serves the revision too)."""
    f = "f" * 32
    assert trained_fingerprint(f) == f
    for allow in (False, True):
        assert trained_fingerprint(served_fingerprint(f, "int4-g64", allow)) == f + "+int4-g64"
    repack = served_fingerprint(f, "gguf-Q4_1+Q8_0", False)
    assert trained_fingerprint(repack) == f and repack.accepts(trained_fingerprint(repack))


# -- through the Tinker SDK ----------------------------------------------------------------------
def test_the_tinker_sdk_trains_on_an_int4_base_and_samples_what_it_trained(demo_dense, tmp_path):
    """mint (the Tinker SDK) against a server on `--quantize int4`: forward_backward and
    optim_step lower the loss; the sampler of the saved weights scores the datum as the trained
    forward does; the revision names the quantized base."""
    import httpx
    import mint
    from mint import types

    from loraserve.engine.async_engine import AsyncEngine
    from loraserve.keys import Principal, append_key
    from loraserve.server import build_app
    from server.live import LiveServer

    Catalog.create(tmp_path / "catalog", shards=1).close()
    key = append_key(tmp_path / "keys.toml", Principal("trainer", admin=False, tenants=("lab",)))
    engine = AsyncEngine.from_config(EngineConfig(
        model_dir=str(demo_dense), catalog_dir=str(tmp_path / "catalog"), device="cpu", compile="off",
        max_model_len=128, torch_threads=1, train_max_tokens=24, train_state_dir=str(tmp_path / "state"),
        quantize="int4"))
    toks = [(11 * j) % 250 + 1 for j in range(15)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)})
    with LiveServer(build_app(engine, keys=tmp_path / "keys.toml")) as live:
        service = mint.ServiceClient(base_url=live.url, api_key=key)
        trainer = service.create_lora_training_client(base_model=demo_dense.name, rank=4, seed=0)
        losses = []
        for _ in range(3):
            fb = trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0]
        named = trainer.save_weights_for_sampler("q").result().path  # written to the catalog
        sampler = service.create_sampling_client(model_path=named)
        trained = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        served = sampler.compute_logprobs(types.ModelInput.from_ints(toks)).result()
        assert served[1:] == pytest.approx(trained, abs=SERVE_ATOL)
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}) as http:
            record = http.get(f"/v1/adapters/lab/{trainer.model_id}").json()
        assert record["base_fingerprint"] == base_fingerprint(demo_dense) + "+int4-g64"
