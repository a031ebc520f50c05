"""optim_step refuses what would break a run or could not be served, and the run goes on.

Adam parameters no step can use (NaN, Inf, negative, betas outside [0, 1), eps not above 0, past
float32) and a step whose factors would leave the serving bound (catalog.bounds: NaN/Inf, or a
gain rank x max|B| x ||A||_inf past the serving dtype's limit, the check every imported revision
passes) are a 400 naming the parameter; the run is then exactly as before (factors, Adam moments,
step count, gradients), and a step with sane parameters goes on from there. Before, lr 1e30 was
taken (and every later pass failed on non-finite losses) and lr 1e39 was a 500.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from loraserve.catalog.bounds import GAIN_LIMITS
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.training import trainer_of
from loraserve.engine.types import EngineError

RUN = {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
SANE = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def core(demo_dense):
    engine = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=64,
                                    torch_threads=1))
    return trainer_of(engine)


def _datum(n: int = 12) -> list:
    toks = [(5 * i) % 250 + 1 for i in range(n + 1)]
    return [toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * n}]


def _backward(core, run_id: str, pass_id: str) -> float:
    core.begin(run_id, pass_id, [_datum()], "cross_entropy", None, True, "t", 1.0)
    while (out := core.advance(pass_id, 64)) is None:
        pass
    return out["metrics"]["loss:sum"]


def _state(core, run_id: str) -> dict[str, torch.Tensor]:
    run = core.runs[run_id]
    state = {k: v.detach().clone() for k, v in run.state_tensors().items()}
    for i, g in enumerate(run.grads or []):
        state[f"grad.{i}"] = g.clone()
    state["steps"] = torch.tensor(run.steps)
    return state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fresh(core, run_id: str, steps: int = 1) -> None:
    """A run with `steps` sane steps taken and one more pass's gradients pending."""
    core.drop(run_id)
    core.create(run_id, RUN)
    for i in range(steps):
        _backward(core, run_id, f"{run_id}-{i}")
        core.optim_step(run_id, SANE)
    _backward(core, run_id, f"{run_id}-pending")


def _servable(core, run_id: str) -> bool:
    limit = GAIN_LIMITS["float32"]
    return all(math.isfinite(g) and g <= limit for _, g, _ in core.runs[run_id].factors.gains())


@pytest.mark.parametrize("change, param", [
    ({"learning_rate": 1e30}, "learning_rate"),    # taken before: the factors past any bound
    ({"learning_rate": 1e39}, "learning_rate"),    # a 500 before: float32 overflow in torch
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"learning_rate": float("inf")}, "learning_rate"),
    ({"learning_rate": -1e-3}, "learning_rate"),
    ({"beta1": 1.0}, "beta1"),                     # a ZeroDivisionError in torch's bias correction
    ({"beta1": -0.1}, "beta1"),
    ({"beta2": 1.5}, "beta2"),
    ({"beta2": float("nan")}, "beta2"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"),
    ({"eps": 1e300}, "eps"),
    ({"weight_decay": -0.5}, "weight_decay"),
    ({"weight_decay": float("inf")}, "weight_decay"),
    ({"learning_rate": 1e30, "weight_decay": 1e10}, "weight_decay"),
    ({"grad_clip_norm": -1.0}, "grad_clip_norm"),
    ({"learning_rate": 1e6}, "learning_rate"),     # finite arithmetic, yet a gain past 1e12
])
def test_a_refused_step_is_a_400_naming_it_and_changes_nothing(core, change, param):
    _fresh(core, "r")
    before = _state(core, "r")
    with pytest.raises(EngineError) as err:
        core.handle("optim_step", ["r", {**SANE, **change}])
    assert err.value.status == 400 and err.value.code == "training_error"
    assert err.value.param == param and param in str(err.value), str(err.value)
    assert _same(before, _state(core, "r"))
    assert _servable(core, "r")


def test_the_run_goes_on_after_a_refused_step_as_if_it_never_came(core):
    """A refused step then a sane one equals the sane one alone (gradients kept, moments and
    step count untouched), and the run keeps training."""
    _fresh(core, "twin")
    core.optim_step("twin", SANE)
    _fresh(core, "r")
    with pytest.raises(EngineError, match="learning_rate"):
        core.handle("optim_step", ["r", {**SANE, "learning_rate": 1e30}])
    assert core.optim_step("r", SANE)["steps"] == 2
    assert _same({k: v for k, v in _state(core, "r").items() if k != "steps"},
                 {k: v for k, v in _state(core, "twin").items() if k != "steps"})
    loss = _backward(core, "r", "again")
    assert math.isfinite(loss)


def test_the_bound_is_the_serving_one(core):
    """A step is refused exactly when the factors after it would be refused at import: the
    serving layout of the accepted factors passes catalog.bounds.check_servable."""
    from loraserve.catalog.bounds import check_servable

    _fresh(core, "r")
    core.optim_step("r", {**SANE, "learning_rate": 1e3})  # big, yet servable
    weights = core.runs["r"].factors.serving_weights("fp", torch.float32, "test")
    check_servable(weights.tensors, "float32")


# -- generated parameters -------------------------------------------------------------------------

ODD = st.one_of(st.floats(allow_nan=True, allow_infinity=True),    # anything at all
                st.sampled_from([0.0, 1e-45, 1e-300, 1.0, 3.4e38, 3.5e38, 1e30, 1e39, -1e-3,
                                 float("nan"), float("inf"), -float("inf")]))


def _field(usual) -> st.SearchStrategy[float]:
    """Mostly a value of the field's usual range (so that whole parameter sets are often taken),
    else a finite, huge, tiny, NaN, Inf or negative one."""
    return st.one_of(usual, usual, usual, usual, usual, ODD)


BETA = st.floats(min_value=0, max_value=1, exclude_max=True)
POSITIVE = st.floats(min_value=0, max_value=1e40)


def test_any_adam_params_are_taken_within_the_bound_or_refused_with_nothing_changed(core):
    """Generated parameter sets: each taken (factors finite, servable) or refused with a 400
    naming its field and nothing changed; and some of them taken, not only refusals."""
    accepted: list[dict] = []

    @settings(max_examples=80, deadline=None, derandomize=True)
    @given(learning_rate=_field(st.one_of(st.floats(0, 1), st.floats(0, 1e4), POSITIVE)), beta1=_field(BETA),
           beta2=_field(BETA), eps=_field(st.floats(1e-30, 1.0)), weight_decay=_field(st.floats(0, 1)),
           grad_clip_norm=_field(POSITIVE))
    def one(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm):
        if "h" not in core.runs:
            _fresh(core, "h")
        elif core.runs["h"].grads is None:
            try:
                _backward(core, "h", "h-next")
            except ValueError:  # factors within the bound can still overflow a loss: start again
                _fresh(core, "h")
        adam = dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    grad_clip_norm=grad_clip_norm)
        before = _state(core, "h")
        try:
            out = core.handle("optim_step", ["h", adam])
        except EngineError as exc:  # anything else (a 500) fails the test
            assert exc.status == 400 and exc.param in adam, (exc, exc.param)
            assert _same(before, _state(core, "h"))
        else:
            accepted.append(adam)
            assert out["steps"] == int(before["steps"]) + 1
            assert all(torch.isfinite(p).all() for p in core.runs["h"].factors.parameters())
            assert _servable(core, "h")

    one()
    assert accepted  # some sets were taken, not only refusals
