"""AdapterPool: layout round trip, bounds, LRU, refcount and pin protection, clear errors."""
from types import SimpleNamespace

import pytest
import torch
from adapter_fakes import make_weights, read_back, tiny_specs

from loraserve.adapters.pool import AdapterPool, PoolConfig, PoolFull, TargetSpec, tensor_names


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def new_pool(**cfg) -> AdapterPool:
    cfg.setdefault("max_slots", 3)
    cfg.setdefault("max_rank", 8)
    return AdapterPool(tiny_specs(), PoolConfig(**cfg))


def free_rows(pool: AdapterPool, kind: str) -> int:
    return pool.rows_per_kind - sum(int(r) for r in pool.ranks[kind])


def test_tensor_names_follow_the_blob_contract():
    assert tensor_names("q_proj", 3) == ("layers.3.self_attn.q_proj.lora_A", "layers.3.self_attn.q_proj.lora_B")
    assert tensor_names("up_proj", 0) == ("layers.0.mlp.up_proj.lora_A", "layers.0.mlp.up_proj.lora_B")
    assert tensor_names("experts.down_proj", 2)[1] == "layers.2.mlp.experts.down_proj.lora_B"
    assert tensor_names("lm_head", 0) == ("lm_head.lora_A", "lm_head.lora_B")
    with pytest.raises(ValueError, match="unknown LoRA target kind"):
        tensor_names("qkv_proj", 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [1, 3, 8])
def test_load_round_trips_every_kind_in_row_layout(rank, device):
    pool = new_pool(device=device)
    weights = make_weights(pool.specs.values(), rank, seed=rank)
    slot = pool.load(("t/a", "r1"), weights)
    back = read_back(pool, slot)
    assert back.keys() == weights.tensors.keys()
    for name, tensor in weights.tensors.items():
        assert torch.equal(back[name].cpu(), tensor), name
    assert all(int(pool.ranks[k][slot]) == rank for k in pool.specs)
    pool.check_invariants()


def test_load_converts_to_the_pool_dtype():
    pool = new_pool()
    weights = make_weights(pool.specs.values(), 2, dtype=torch.bfloat16)
    back = read_back(pool, pool.load(("t/a", "r1"), weights))
    for name, tensor in weights.tensors.items():
        assert back[name].dtype == torch.float32
        assert torch.equal(back[name], tensor.float()), name


def test_rows_per_kind_without_and_with_a_byte_bound():
    assert new_pool(max_slots=3, max_rank=8).rows_per_kind == 24
    per_row = sum(new_pool().row_bytes.values())
    pool = new_pool(max_slots=3, max_rank=8, max_bytes=10 * per_row + per_row // 2)
    assert pool.rows_per_kind == 10
    assert pool.bytes_capacity == 10 * per_row
    allocated = sum(t.numel() * t.element_size() for side in (pool.A_rows, pool.B_rows)
                    for layers in side.values() for t in layers.values())
    assert allocated == pool.bytes_capacity
    with pytest.raises(ValueError, match="below one rank row"):
        new_pool(max_bytes=per_row - 1)


def test_an_adapter_costs_its_rank_in_the_kinds_it_targets_only():
    pool = new_pool()
    pool.load(("t/a", "r1"), make_weights(pool.specs.values(), 3, ["q_proj"]))
    pool.load(("t/b", "r1"), make_weights(pool.specs.values(), 5, ["q_proj", "lm_head"]))
    assert free_rows(pool, "q_proj") == 24 - 8
    assert free_rows(pool, "lm_head") == 24 - 5
    assert free_rows(pool, "v_proj") == 24
    stats = pool.stats
    assert stats.bytes_used == 8 * pool.row_bytes["q_proj"] + 5 * pool.row_bytes["lm_head"]
    assert stats.resident_adapters == 2
    pool.check_invariants()


def test_lru_evicts_the_least_recently_used_idle_adapter():
    pool = new_pool(max_slots=2)
    specs = pool.specs.values()
    pool.load(("t/a", "r"), make_weights(specs, 2))
    pool.load(("t/b", "r"), make_weights(specs, 2))
    assert pool.slot_of(("t/a", "r")) is not None  # touch a: b is now LRU
    pool.load(("t/c", "r"), make_weights(specs, 2))
    assert set(pool.resident()) == {("t/a", "r"), ("t/c", "r")}
    assert pool.stats.evictions == 1
    pool.check_invariants()


def test_in_use_adapters_are_never_evicted_and_pool_full_is_clear():
    pool = new_pool(max_slots=2)
    specs = pool.specs.values()
    a = pool.load(("t/a", "r"), make_weights(specs, 2))
    pool.load(("t/b", "r"), make_weights(specs, 2))
    assert pool.acquire(("t/a", "r")) == a
    assert pool.acquire(("t/b", "r")) != a
    with pytest.raises(PoolFull, match="in-use or pinned"):
        pool.load(("t/c", "r"), make_weights(specs, 2))
    pool.release(a)
    pool.load(("t/c", "r"), make_weights(specs, 2))
    assert ("t/a", "r") not in pool and ("t/b", "r") in pool
    pool.check_invariants()


def test_row_shortage_evicts_only_adapters_that_free_the_missing_rows():
    per_row = sum(new_pool().row_bytes.values())
    pool = new_pool(max_slots=4, max_rank=4, max_bytes=8 * per_row)  # 8 rows per kind
    specs = pool.specs.values()
    pool.load(("t/v", "r"), make_weights(specs, 4, ["v_proj"]))  # LRU, but frees no q rows
    pool.load(("t/q1", "r"), make_weights(specs, 4, ["q_proj"]))
    pool.load(("t/q2", "r"), make_weights(specs, 4, ["q_proj"]))  # q rows full, a slot free
    pool.load(("t/q3", "r"), make_weights(specs, 4, ["q_proj"]))
    assert pool.resident() == [("t/v", "r"), ("t/q2", "r"), ("t/q3", "r")]
    assert pool.stats.evictions == 1
    pool.check_invariants()


def test_pinned_adapters_stay_until_unpinned():
    pool = new_pool(max_slots=1)
    specs = pool.specs.values()
    pool.load(("t/a", "r"), make_weights(specs, 2))
    pool.pin(("t/a", "r"))
    assert not pool.evict(("t/a", "r"))
    with pytest.raises(PoolFull):
        pool.load(("t/b", "r"), make_weights(specs, 2))
    pool.unpin(("t/a", "r"))
    pool.load(("t/b", "r"), make_weights(specs, 2))
    assert pool.resident() == [("t/b", "r")]
    with pytest.raises(KeyError, match="not resident"):
        pool.pin(("t/zz", "r"))


def test_evict_refuses_in_use_and_counts_evictions():
    pool = new_pool()
    slot = pool.load(("t/a", "r"), make_weights(pool.specs.values(), 2))
    pool.acquire(("t/a", "r"))
    assert not pool.evict(("t/a", "r"))
    pool.release(slot)
    assert pool.evict(("t/a", "r"))
    assert not pool.evict(("t/a", "r"))
    assert pool.stats.evictions == 1 and pool.entry(("t/a", "r")) is None
    assert all(int(pool.ranks[k][slot]) == 0 for k in pool.specs)
    pool.check_invariants()


def test_refcount_errors_are_clear():
    pool = new_pool()
    with pytest.raises(KeyError, match="load it first"):
        pool.acquire(("t/a", "r"))
    slot = pool.load(("t/a", "r"), make_weights(pool.specs.values(), 2))
    with pytest.raises(ValueError, match="no acquired adapter"):
        pool.release(slot)
    with pytest.raises(ValueError, match="no acquired adapter"):
        pool.release(99)


def test_hits_misses_and_idempotent_load():
    pool = new_pool()
    assert pool.slot_of(("t/a", "r")) is None
    slot = pool.load(("t/a", "r"), make_weights(pool.specs.values(), 2))
    assert pool.load(("t/a", "r"), make_weights(pool.specs.values(), 2)) == slot
    assert pool.slot_of(("t/a", "r")) == slot
    stats = pool.stats
    assert (stats.hits, stats.misses, stats.loads) == (1, 1, 1)


def test_layers_an_adapter_skips_get_zero_rows_even_in_reused_rows():
    pool = new_pool(max_slots=1, max_rank=4)
    specs = pool.specs.values()
    pool.load(("t/full", "r"), make_weights(specs, 4, ["q_proj"]))
    partial = make_weights(specs, 4, ["q_proj"], seed=7, layers=[0])
    back = read_back(pool, pool.load(("t/part", "r"), partial))  # evicts t/full, reuses its rows
    assert torch.equal(back["layers.0.self_attn.q_proj.lora_A"], partial.tensors["layers.0.self_attn.q_proj.lora_A"])
    assert not back["layers.1.self_attn.q_proj.lora_A"].any()
    assert not back["layers.1.self_attn.q_proj.lora_B"].any()


def test_adapters_that_can_never_fit_name_the_problem():
    pool = new_pool(max_rank=4)
    specs = list(pool.specs.values())
    with pytest.raises(ValueError, match="rank 5 exceeds"):
        pool.load(("t/a", "r"), make_weights(specs, 5))
    other_base = [TargetSpec("k_proj", [0], 8, 4)]
    with pytest.raises(ValueError, match="layers.0.self_attn.k_proj.lora_A"):
        pool.load(("t/x", "r"), make_weights(other_base, 2))
    wide = [TargetSpec("q_proj", [0], 10, 8)]
    with pytest.raises(ValueError, match=r"q_proj.lora_A' has shape \(2, 10\)"):
        pool.load(("t/a", "r"), make_weights(wide, 2))
    deep = [TargetSpec("q_proj", [5], 8, 8)]
    with pytest.raises(ValueError, match="layers.5.self_attn.q_proj"):
        pool.load(("t/a", "r"), make_weights(deep, 2))
    half = SimpleNamespace(rank=2, tensors={"lm_head.lora_A": torch.zeros(2, 8)})
    with pytest.raises(ValueError, match="lora_B is missing"):
        pool.load(("t/a", "r"), half)
    assert pool.resident() == [] and pool.stats.loads == 0
    pool.check_invariants()


def test_config_and_spec_validation():
    with pytest.raises(ValueError, match="max_slots"):
        PoolConfig(max_slots=0)
    with pytest.raises(ValueError, match="max_rank"):
        PoolConfig(max_slots=1, max_rank=0)
    with pytest.raises(ValueError, match="floating"):
        PoolConfig(max_slots=1, dtype=torch.int8)
    with pytest.raises(ValueError, match="experts"):
        TargetSpec("experts.up_proj", [0], 8, 8)
    with pytest.raises(ValueError, match="only experts"):
        TargetSpec("up_proj", [0], 8, 8, experts=2)
    with pytest.raises(ValueError, match="distinct"):
        TargetSpec("q_proj", [0, 0], 8, 8)
    with pytest.raises(ValueError, match="duplicate"):
        AdapterPool([TargetSpec("q_proj", [0], 8, 8)] * 2, PoolConfig(max_slots=1))
    assert TargetSpec("lm_head", [], 8, 16).layers == [0]


def test_admission_check_from_a_record_needs_no_weights():
    pool = new_pool(max_rank=4)
    pool.check_admissible(4, ["q_proj", "experts.gate_proj"])
    with pytest.raises(ValueError, match="outside this server's LoRA ranks 1..4"):
        pool.check_admissible(5, ["q_proj"])
    with pytest.raises(ValueError, match="targets k_proj"):
        pool.check_admissible(2, ["q_proj", "k_proj"])
