"""The replica routing policy (loraserve/ray_serve/routing.py): rendezvous hashing with bounded
loads, held adapters first. Pure functions, no Ray."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.ray_serve.routing import (Residency, least_loaded, load_bound, owners, preference,
                                         route, spill_order, weight)

replica_names = st.lists(st.text("abcdef0123456789", min_size=4, max_size=8), min_size=2,
                         max_size=8, unique=True)
adapter_ids = st.lists(st.from_regex(r"t[0-9]/a[0-9]{1,4}", fullmatch=True), min_size=1,
                       max_size=60, unique=True)


def test_weight_is_stable_and_depends_on_both():
    """The same (replica, adapter) weighs the same in every process (no salted hash())."""
    assert weight("r1", "t/a") == weight("r1", "t/a")
    assert weight("r1", "t/a") != weight("r2", "t/a")
    assert weight("r1", "t/a") != weight("r1", "t/b")
    assert 0 <= weight("r1", "t/a") < 2**64


def test_preference_is_a_permutation_independent_of_input_order():
    reps = ["a", "b", "c", "d"]
    order = preference("t/x", reps)
    assert sorted(order) == reps
    assert preference("t/x", list(reversed(reps))) == order


def test_load_bound():
    assert load_bound(0, 2) == 1            # an idle cluster: anything may go anywhere
    assert load_bound(7, 2, 1.25) == 5      # ceil(1.25 * 8 / 2)
    assert load_bound(9, 3, 1.0) == 4       # c = 1: exactly the mean, rounded up
    with pytest.raises(ValueError):
        load_bound(3, 2, 0.9)
    with pytest.raises(ValueError):
        load_bound(3, 0)


def test_idle_cluster_sends_each_adapter_to_its_first_choice():
    loads = {"a": 0, "b": 0, "c": 0}
    for key in (f"t/{i}" for i in range(50)):
        assert spill_order(key, loads)[0] == preference(key, loads)[0]


def test_spill_goes_to_the_adapters_own_next_choice():
    reps = ["a", "b", "c", "d"]
    key = "t/hot"
    first, second, third, _ = preference(key, reps)
    loads = {r: 1 for r in reps}
    loads[first] = 10  # bound = ceil(1.25 * 14 / 4) = 5
    assert spill_order(key, loads)[:2] == [second, third]
    assert spill_order(key, loads)[-1] == first  # tried last, when nothing under the bound has room


def test_base_only_goes_least_loaded_ties_shared():
    loads = {"a": 3, "b": 1, "c": 1}
    firsts = {route(None, loads, rng=random.Random(s))[0] for s in range(40)}
    assert firsts == {"b", "c"}
    assert least_loaded(loads, random.Random(0))[-1] == "a"
    assert route("", loads, rng=random.Random(0))[-1] == "a"


def test_about_one_in_r_adapters_per_replica():
    reps = [f"r{i}" for i in range(4)]
    counts = {r: 0 for r in reps}
    for owner in owners([f"t/{i}" for i in range(4000)], reps).values():
        counts[owner] += 1
    assert all(800 < n < 1200 for n in counts.values()), counts


@settings(max_examples=60, deadline=None, derandomize=True)
@given(reps=replica_names, keys=adapter_ids, data=st.data())
def test_only_a_dead_replicas_adapters_move(reps, keys, data):
    """A replica's death moves the adapters it owned and no other (idle loads: no spill)."""
    dead = data.draw(st.sampled_from(reps))
    before = owners(keys, reps)
    after = owners(keys, [r for r in reps if r != dead])
    for k in keys:
        if before[k] != dead:
            assert after[k] == before[k]
        else:
            assert after[k] != dead


@settings(max_examples=60, deadline=None, derandomize=True)
@given(reps=replica_names, keys=adapter_ids, data=st.data())
def test_a_new_replica_takes_only_what_it_now_tops(reps, keys, data):
    new = "z" + data.draw(st.text("0123456789", min_size=3, max_size=5))
    before = owners(keys, reps)
    after = owners(keys, [*reps, new])
    assert all(after[k] in (before[k], new) for k in keys)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(reps=replica_names, key=st.text(min_size=1, max_size=12),
       c=st.sampled_from([1.0, 1.1, 1.25, 2.0]), data=st.data())
def test_no_replica_over_the_bound_while_another_has_room(reps, key, c, data):
    loads = {r: data.draw(st.integers(0, 40)) for r in reps}
    order = spill_order(key, loads, c)
    bound = load_bound(sum(loads.values()), len(loads), c)
    assert sorted(order) == sorted(reps)
    under = [r for r in order if loads[r] < bound]
    assert under, "some replica is always under ceil(c x mean) with c >= 1"
    assert order[0] == under[0] and loads[order[0]] + 1 <= bound
    # the under-bound ones: the less loaded of its first two choices first, then its own
    # preference order
    pref = preference(key, reps)
    first_two = sorted((r for r in pref[:2] if loads[r] < bound), key=lambda r: loads[r])
    assert under == first_two + [r for r in pref if loads[r] < bound and r not in first_two]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(reps=replica_names, key=st.text(min_size=1, max_size=12), data=st.data())
def test_a_held_adapter_goes_to_its_holders_first_whatever_their_load(reps, key, data):
    """Holders first (Serve skips a full one): a hit is worth more than balance."""
    loads = {r: data.draw(st.integers(0, 40)) for r in reps}
    held = data.draw(st.lists(st.sampled_from(reps), unique=True))
    order = spill_order(key, loads, held=held)
    assert sorted(order) == sorted(reps)
    assert order[:len(held)] == [r for r in preference(key, reps) if r in held]


def test_a_new_adapter_goes_to_the_less_loaded_of_its_first_two_choices():
    reps = ["a", "b", "c", "d"]
    first, second, third, fourth = preference("t/new", reps)
    loads = {first: 2, second: 1, third: 0, fourth: 0}  # bound ceil(1.25 * 4 / 4) = 2
    assert spill_order("t/new", loads)[:3] == [second, third, fourth]
    loads = dict.fromkeys(reps, 1)  # a tie: its first choice
    assert spill_order("t/new", loads) == [first, second, third, fourth]


def test_residency_is_an_lru_per_replica():
    res = Residency(slots=2)
    for key in ("t/a", "t/b", "t/a", "t/c"):  # t/b is the least recent when t/c comes
        res.touch("r1", key)
    res.touch("r2", "t/b")
    assert res.holders("t/a", ["r1", "r2"]) == ["r1"]
    assert res.holders("t/b", ["r1", "r2"]) == ["r2"]
    res.keep({"r1"})
    assert res.holders("t/b", ["r1", "r2"]) == []
    res.forget("r1")
    assert res.holders("t/a", ["r1"]) == []
    with pytest.raises(ValueError):
        Residency(0)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(reps=replica_names, seed=st.integers(0, 2**16), c=st.sampled_from([1.0, 1.25, 1.5]))
def test_placing_a_stream_keeps_every_replica_within_the_bound(reps, seed, c):
    """Requests placed one after another (none ending) by their first choice: no replica ever
    holds more than the bound of the moment it took its last request."""
    rng = random.Random(seed)
    loads = {r: 0 for r in reps}
    for _ in range(200):
        key = f"t/{int(rng.paretovariate(1.1)) % 50}"
        bound = load_bound(sum(loads.values()), len(loads), c)
        chosen = route(key, loads, c)[0]
        loads[chosen] += 1
        assert loads[chosen] <= bound
