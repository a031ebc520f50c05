"""The factor-gain check (`catalog.bounds`): one rule, at every entry.

The issue's variants (factors of 1e19 on k/v, on every target, on lm_head; float16's largest
value) are refused by the export, by `save_revision` (every writer), by the import of an
exported blob, by the page-in's flat check and by the audit, each naming the target. The page-in
computes the gain from the blob's flat data region in a few numpy calls (`GainPlan`); a
property test holds it to the per-target reference on random layouts and heavy-tailed values.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.catalog.bounds import GAIN_LIMITS, check_servable, target_gains
from loraserve.catalog.errors import CorruptBlob, FactorsTooLarge, NonFiniteWeights
from loraserve.catalog.layout import load_revision, save_revision

from adapter_fakes import make_weights, tiny_specs

SPECS = tiny_specs()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _filled(kinds: list[str], value: float, dtype=torch.float32, seed: int = 1):
    """A small random adapter whose `kinds` factors are all `value` (the issue's variants)."""
    weights = make_weights(SPECS, 2, seed=seed, dtype=dtype)
    for name, t in weights.tensors.items():
        if any(f".{k}." in name or name.startswith(f"{k}.") for k in kinds):
            t.fill_(value)
    return weights


VARIANTS = {  # the row 1: huge but finite factors, each through every entry
    "k_v_1e19": (["k_proj", "v_proj", "q_proj"], 1e19, torch.float32),
    "all_targets_1e19": ([s.kind for s in SPECS], 1e19, torch.float32),
    "lm_head_1e19": (["lm_head"], 1e19, torch.float32),
    "float16_max": (["q_proj"], 65504.0, torch.float16),
    "bfloat16_max": (["v_proj"], torch.finfo(torch.bfloat16).max, torch.bfloat16),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_huge_finite_factors_are_refused_at_every_entry(variant):
    kinds, value, dtype = VARIANTS[variant]
    weights = _filled(kinds, value, dtype)
    with pytest.raises(FactorsTooLarge, match=r"can scale an activation by .* never served"):
        save_revision(weights)  # every writer: export, import, runtime load, training saves
    blob = bytearray(save_revision(weights, check=False))  # written behind the writers' back
    with pytest.raises(FactorsTooLarge, match="acme/x@r1"):
        load_revision(blob, what="adapter acme/x@r1", finite=True)  # the page-in
    assert load_revision(blob).rank == 2  # unchecked decode still parses it: the check is the refusal


def test_the_compute_dtype_narrows_the_limit():
    """A float32 blob whose gain float32 holds but float16 does not is refused by a float16 engine."""
    weights = make_weights(SPECS, 2, seed=3)
    gain = max(target_gains(weights.tensors).values())
    scale = (GAIN_LIMITS["float16"] * 10 / gain) ** 0.5  # both factors scaled: gain x scale^2
    for t in weights.tensors.values():
        t.mul_(scale)
    blob = save_revision(weights)  # fine for float32 serving
    assert load_revision(bytearray(blob), finite=True, compute_dtype="float32")
    with pytest.raises(FactorsTooLarge, match="float16"):
        load_revision(bytearray(blob), finite=True, compute_dtype="float16")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_is_named_as_such(bad):
    weights = make_weights(SPECS, 2, seed=4)
    name = sorted(weights.tensors)[0]
    weights.tensors[name].view(-1)[0] = bad
    with pytest.raises(NonFiniteWeights, match=name.rpartition(".")[0]):
        check_servable(weights.tensors, "float32")
    with pytest.raises(CorruptBlob, match=f"tensor {name} holds NaN or Inf"):
        load_revision(bytearray(save_revision(weights, check=False)), finite=True)


def test_ordinary_adapters_pass_with_room():
    """Random N(0, 1) factors (far larger than trained adapters' ~0.01) are nowhere near a limit."""
    for dtype in DTYPES:
        weights = make_weights(SPECS, 4, seed=5, dtype=dtype)
        assert max(target_gains(weights.tensors).values()) < GAIN_LIMITS["float16"] / 10
        assert load_revision(bytearray(save_revision(weights)), finite=True)


_MAGNITUDES = st.sampled_from([0.0, 1e-42, 1e-30, 1e-3, 1.0, 1e3, 1e8, 1e15, 1e19, 1e30, 65504.0])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rank=st.integers(1, 4), dtype=st.sampled_from(DTYPES),
       spikes=st.lists(st.tuples(st.integers(0, 10_000), _MAGNITUDES, st.booleans()), max_size=6),
       tail=st.floats(0.5, 3.0), kinds=st.sets(st.sampled_from([s.kind for s in SPECS]), min_size=1))
def test_flat_gain_equals_per_target_gains(seed, rank, dtype, spikes, tail, kinds):
    """The page-in's flat check (`GainPlan`, one reduceat over the whole blob) accepts exactly
    what the per-target reference accepts, on random layouts (dense, MoE, lm_head, any rank and
    dtype) with heavy-tailed values and spikes of extreme magnitudes, subnormals included."""
    gen = np.random.default_rng(seed)
    weights = make_weights(SPECS, rank, kinds=sorted(kinds), seed=seed % 1000, dtype=dtype)
    for t in weights.tensors.values():  # Student-t with `tail` degrees of freedom: heavy tails
        heavy = torch.from_numpy(gen.standard_t(tail, size=t.shape).astype(np.float32))
        t.copy_(heavy.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype))
    names = sorted(weights.tensors)
    for where, magnitude, negative in spikes:
        t = weights.tensors[names[where % len(names)]].view(-1)
        t[where % t.numel()] = -magnitude if negative else magnitude
    with np.errstate(over="ignore"):
        reference = max(target_gains(weights.tensors).values())
    name = str(dtype).removeprefix("torch.")
    blob = bytearray(save_revision(weights, check=False))
    if reference <= GAIN_LIMITS[name]:
        assert load_revision(blob, finite=True)
        return
    with pytest.raises((FactorsTooLarge, CorruptBlob)):
        load_revision(blob, finite=True)


@pytest.mark.parametrize("scale", [0.999, 1.001, 0.4999, 0.5001])
def test_the_float32_first_check_decides_as_the_float64_one_at_the_limit(scale):
    """`GainPlan.gain(flat, limit)` sums rows in float32 first and keeps that only far under the
    limit: adapters whose gain sits just under or over the limit (or just around half of it,
    where the float32 answer stops being kept) are accepted or refused exactly as the float64
    reference decides, and the float32 sums overflowing is refused as too large, not NaN."""
    weights = make_weights(SPECS, 2, kinds=["q_proj"], seed=3)
    reference = max(target_gains(weights.tensors).values())
    target = GAIN_LIMITS["float32"] * scale
    for name, t in weights.tensors.items():  # A scaled so that the gain lands on `target`
        if name.endswith("lora_A"):
            t.mul_(target / reference)
    expected = max(target_gains(weights.tensors).values()) <= GAIN_LIMITS["float32"]
    blob = bytearray(save_revision(weights, check=False))
    if expected:
        assert load_revision(blob, finite=True)
    else:
        with pytest.raises(FactorsTooLarge):
            load_revision(blob, finite=True)


def test_a_float32_overflow_of_the_row_sums_is_refused_as_too_large():
    weights = _filled(["q_proj"], 3e38)  # a row of A sums past float32's range
    with pytest.raises(FactorsTooLarge):
        load_revision(bytearray(save_revision(weights, check=False)), finite=True)
