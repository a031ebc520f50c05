"""The decode plan (`model.decode_plan`): an eager CPU decode step runs the layers as a flat list
of calls, gives the module path's tokens and hidden states on every dense family (Qwen3's q/k
norm, Qwen2's q/k/v biases, Mistral's window, Llama) and on an int4 base, and steps aside for
whatever the module path honours: a hook, a module replaced after it was built (an active
adapter: tests/lora/test_peft_parity.py)."""
from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 (whole before any engine: its grammar thread imports it too, and a
# first `import transformers` here while that thread's is half done finds a partial module)

from loraserve.engine.config import EngineConfig
from loraserve.engine.core.attention import PagedAttention
from loraserve.engine.core.build import build_engine
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.model import decode_plan


def _engine(model_dir, **kw):
    return build_engine(EngineConfig(model_dir=str(model_dir), max_model_len=64, compile="off",
                                     prefix_caching=False, max_batch_size=4, **kw))


def _spy(eng, monkeypatch) -> tuple[list[torch.Tensor], list[int]]:
    """(the hidden states each step hands to the logits, one entry per planned step)."""
    model, hidden, planned = eng.runner.model, [], []
    real_logits, real_run = type(model).compute_logits, decode_plan.DecodePlan.run
    monkeypatch.setattr(type(model), "compute_logits", lambda self, h: hidden.append(h.clone()) or real_logits(self, h))
    monkeypatch.setattr(decode_plan.DecodePlan, "run",
                        lambda self, x, a, deltas=False: planned.append(1) or real_run(self, x, a, deltas))
    return hidden, planned


def _generate(eng, tag: str, adapter=None) -> list[list[int]]:
    prompts = [[3, 14, 15, 9, 2, 6], [7, 1, 8, 2, 8], [5, 5, 4]]
    seqs = [eng.add_request(GenerateRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=6, temperature=0.0,
                                                                            ignore_eos=True), adapter))
            for i, p in enumerate(prompts)]
    while eng.has_work():
        eng.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("fixture,extra", [("demo_dense", {}), ("hf_llama", {}), ("hf_qwen2", {}),
                                           ("hf_mistral", {}), ("hf_llama", {"quantize": "int4"})],
                         ids=["qwen3", "llama", "qwen2-bias", "mistral-window", "llama-int4"])
def test_the_plan_gives_the_module_paths_numbers(fixture, extra, request, monkeypatch):
    eng = _engine(request.getfixturevalue(fixture), **extra)
    hidden, planned = _spy(eng, monkeypatch)
    fast = _generate(eng, "plan"), list(hidden)
    assert len(planned) == 5  # every decode step of the batch (6 tokens: 1 prefill + 5 decode steps)
    hidden.clear(), planned.clear()
    monkeypatch.setattr(PagedAttention, "qkv_decoder", None)  # the attention function has no decoder: modules
    slow = _generate(eng, "modules"), list(hidden)
    assert not planned
    assert fast[0] == slow[0]
    for a, b in zip(fast[1], slow[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fixture,extra", [("demo_dense", {}), ("demo_dense", {"dtype": "bfloat16"}),
                                           ("hf_llama", {}), ("hf_qwen2", {}), ("hf_mistral", {}),
                                           ("hf_llama", {"quantize": "int4"})],
                         ids=["qwen3", "qwen3-bf16", "llama", "qwen2-bias", "mistral-window", "llama-int4"])
@pytest.mark.parametrize("linears", ["nn.Linear", "VectorLinear"])
def test_the_loop_in_cpp_gives_the_python_loops_numbers_exactly(fixture, extra, linears, request, monkeypatch):
    """`cpu_fused.decode_layers` runs the plan's loop in C++: the same ops in the same order, so the
    same hidden states to the bit, on every dense family, bfloat16 and an int4 base, over a small
    base's `nn.Linear`s and over the `VectorLinear`s (`cpu_gemv`) of a base that outgrows the cache."""
    from loraserve.engine.core import llm_engine
    if linears == "VectorLinear":
        monkeypatch.setattr(llm_engine, "outgrows_last_level_cache", lambda model: True)
    eng = _engine(request.getfixturevalue(fixture), **extra)
    hidden, planned = _spy(eng, monkeypatch)
    cpp = _generate(eng, "cpp"), list(hidden)
    plan = eng.runner.model.model.__dict__["_plan"][1]
    assert plan.native is not None and len(planned) == 5  # every projection one the C++ loop calls
    hidden.clear()
    monkeypatch.setattr(decode_plan, "NATIVE_LOOP", False)
    python = _generate(eng, "python"), list(hidden)
    assert cpp[0] == python[0]
    for a, b in zip(cpp[1], python[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_projection_the_cpp_loop_cannot_call_leaves_the_loop_in_python(demo_dense, monkeypatch):
    """A projection whose module the C++ loop does not know (here an `nn.Linear` subclass): the
    plan applies, its loop stays in Python (`DecodePlan.native` None), the tokens are the same."""
    eng = _engine(demo_dense)
    want = _generate(eng, "before")
    mlp = eng.runner.model.model.layers[1].mlp
    mlp.down_proj.__class__ = type("Other", (torch.nn.Linear,), {})
    eng.runner.model.model.__dict__.pop("_plan", None)
    hidden, planned = _spy(eng, monkeypatch)
    assert _generate(eng, "after") == want and len(planned) == 5
    plan = eng.runner.model.model.__dict__["_plan"][1]
    assert plan is not None and plan.native is None


def test_a_hook_an_adapter_or_a_replaced_module_is_never_bypassed(demo_dense, monkeypatch, tmp_path):
    eng = _engine(demo_dense)
    hidden, planned = _spy(eng, monkeypatch)
    plain = _generate(eng, "plain")
    assert planned
    layer = eng.runner.model.model.layers[1]
    calls: list[int] = []
    handle = layer.self_attn.o_proj.register_forward_hook(lambda mod, args, out: calls.append(1) or out + 0.5)
    planned.clear()
    try:
        hooked = _generate(eng, "hooked")
    finally:
        handle.remove()
    assert not planned and len(calls) == 6  # the prefill step, then all 5 decode steps
    assert hooked != plain
    # a module put in after the plan was built is called (the registration count rebuilds the plan)
    down = layer.mlp.down_proj

    class Doubled(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.in_features, self.out_features = base, base.in_features, base.out_features

        def forward(self, x):
            calls.append(2)
            return 2 * self.base(x)

    calls.clear(), planned.clear()
    layer.mlp.down_proj = Doubled(down)
    try:
        doubled = _generate(eng, "doubled")
    finally:
        layer.mlp.down_proj = down
    assert calls.count(2) == 6 and doubled != plain   # the prefill and all 5 decode steps called it
    planned.clear()
    assert _generate(eng, "again") == plain and planned  # the plan is back, rebuilt



def test_generated_interventions_are_never_bypassed(demo_dense, monkeypatch):
    """A seeded generator of what the plan must step aside for: on random projections of random
    layers, forward hooks that return a new tensor or add in place, pre-hooks that scale the
    input, and modules swapped in after the plan was built (with or without a hook), one or two
    at a time. Each trial's tokens and hidden states equal the module path's (the attention
    function's decoder taken away), every intervention runs at every step, and with all removed
    the plan is taken again and gives the untouched answer."""
    import random

    eng = _engine(demo_dense)
    hidden, planned = _spy(eng, monkeypatch)
    plain = _generate(eng, "plain")
    assert planned
    layers = eng.runner.model.model.layers
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "self_attn", "mlp"]

    class Scaled(torch.nn.Module):  # a module put in after the plan was built
        def __init__(self, base, calls):
            super().__init__()
            self.base, self.calls = base, calls
            for attr in ("in_features", "out_features", "lo"):
                if hasattr(base, attr):
                    setattr(self, attr, getattr(base, attr))

        def forward(self, x, *rest):
            self.calls.append(1)
            return 1.5 * self.base(x, *rest)

    rng = random.Random(20261205)
    for trial in range(8):
        calls: list[int] = []
        undo = []
        for _ in range(rng.choice([1, 2])):
            layer = layers[rng.randrange(len(layers))]
            parent_name, _, leaf = rng.choice(names).rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            mod = getattr(parent, leaf)
            kind = rng.choice(["new", "in-place", "pre", "swap"])
            if kind == "swap" and leaf.endswith("proj") and leaf not in ("q_proj", "k_proj", "v_proj",
                                                                         "gate_proj", "up_proj"):
                setattr(parent, leaf, Scaled(mod, calls))
                undo.append(lambda parent=parent, leaf=leaf, mod=mod: setattr(parent, leaf, mod))
                continue
            if kind == "pre":
                h = mod.register_forward_pre_hook(lambda m, args: calls.append(1) or (args[0] * 1.25, *args[1:]))
            elif kind == "in-place" and leaf.endswith("proj"):
                h = mod.register_forward_hook(lambda m, args, out: calls.append(1) or out.add_(0.125))
            else:
                h = mod.register_forward_hook(lambda m, args, out: calls.append(1) or out * 0.75)
            undo.append(h.remove)
        try:
            hidden.clear(), planned.clear()
            got = _generate(eng, f"t{trial}"), list(hidden)
            assert not planned, f"trial {trial}: the plan ran over an intervention"
            per_run = len(calls)
            assert per_run >= 6  # every step (1 prefill + 5 decode) called each intervention
            hidden.clear()
            with monkeypatch.context() as m:
                m.setattr(PagedAttention, "qkv_decoder", None)
                want = _generate(eng, f"m{trial}"), list(hidden)
            assert len(calls) == 2 * per_run
            assert got[0] == want[0]
            for a, b in zip(got[1], want[1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        finally:
            for u in reversed(undo):
                u()
        planned.clear()
        assert _generate(eng, f"after{trial}") == plain and planned
