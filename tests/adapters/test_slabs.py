"""CPU-tier slabs (adapters/slabs.py): a page-in gathered into a slab slot loads the device pool
with exactly what the decoded adapter loads, keeps every page-in check, and reuses its slots."""
import dataclasses
import gc

import pytest
import torch
from adapter_fakes import FINGERPRINT, make_weights, read_back, tiny_specs

from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.pager import Pager, record_key
from loraserve.adapters.pool import AdapterPool, PoolConfig
from loraserve.adapters import slabs as slabs_module
from loraserve.adapters.slabs import Slabs, SlabWeights
from loraserve.catalog.errors import BaseMismatch, CorruptBlob, FactorsTooLarge
from loraserve.catalog.layout import checked_region, load_revision, save_revision
from loraserve.catalog.store import Catalog

SPECS = tiny_specs()
WAIT = 30


def slab_of(slabs: Slabs, weights) -> SlabWeights | None:
    blob = bytearray(save_revision(weights))
    meta, layout, start = checked_region(blob, compute_dtype="float32")
    return slabs.convert(blob, meta, layout, start)


def adapter(i: int):
    """Ranks 1-4, every kind or a few, float32 or bfloat16 (converted into the float32 pool)."""
    kinds = None if i % 2 == 0 else ["q_proj", "experts.gate_proj", "lm_head"]
    dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
    return make_weights(SPECS, 1 + i % 4, kinds=kinds, seed=i, dtype=dtype)


@pytest.mark.parametrize("gather", [True, False], ids=["one-gather", "factor-by-factor"])
def test_a_slab_loads_the_pool_exactly_as_the_decoded_adapter_does(gather, monkeypatch):
    """Twin pools, one loaded from decoded adapters and one from their slabs, hold the same
    rows, row tables and ranks after every load, through evictions that scatter the free rows
    (so some loads take non-contiguous rows); small slots are one gather, large ones are
    copied factor by factor (here every slot, with the bound set to 0)."""
    if not gather:
        monkeypatch.setattr(slabs_module, "GATHER_ELEMS", 0)
    config = PoolConfig(max_slots=3, max_rank=4, max_bytes=None)
    plain, slabbed = AdapterPool(SPECS, config), AdapterPool(SPECS, config)
    slabs = Slabs.for_pool(slabbed)
    for i in range(24):
        weights = load_revision(bytearray(save_revision(adapter(i))))
        entry = slab_of(slabs, weights)
        assert isinstance(entry, SlabWeights) and entry.rank == weights.rank
        key = ("acme/a", f"r{i}")
        assert plain.load(key, weights) == slabbed.load(key, entry)
        for kind in SPECS:
            k = kind.kind
            assert torch.equal(plain._A_all[k], slabbed._A_all[k]) and torch.equal(plain._B_all[k], slabbed._B_all[k])
            assert torch.equal(plain.row_table[k], slabbed.row_table[k])
            assert torch.equal(plain.ranks[k], slabbed.ranks[k])
        slot = slabbed.slot_of(key)
        back = read_back(slabbed, slot)
        assert back.keys() == weights.tensors.keys()
        assert all(torch.equal(back[n], t.float()) for n, t in weights.tensors.items())
        slabbed.check_invariants()


def test_slots_are_reused_and_the_blocks_stay_bounded():
    """A slot is free again once its entry is collected: a long run of page-ins of which a few
    stay alive holds one block, however many went through it."""
    pool = AdapterPool(SPECS, PoolConfig(max_slots=4, max_rank=4))
    slabs = Slabs.for_pool(pool)
    blob = bytearray(save_revision(adapter(0)))
    meta, layout, start = checked_region(blob)
    alive = []
    for _ in range(3000):
        alive.append(slabs.convert(blob, meta, layout, start))
        del alive[:-8]
    one_block = slabs.block_bytes
    assert slabs.block_bytes_allocated <= one_block
    alive.clear()
    gc.collect()
    assert slabs.block_bytes_allocated <= one_block  # the last block stays for the next page-in


def test_an_adapter_that_skips_layers_stays_decoded():
    """No slab plan for a kind with a layer missing: the pool zero-fills that layer itself."""
    pool = AdapterPool(SPECS, PoolConfig(max_slots=2, max_rank=4))
    slabs = Slabs.for_pool(pool)
    partial = make_weights(SPECS, 2, kinds=["q_proj"], layers=[1])
    assert slab_of(slabs, partial) is None


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog.create(tmp_path / "catalog", shards=2)
    for i in range(8):
        cat.put_revision(f"acme/s{i}", save_revision(adapter(i)))
    nan = make_weights(SPECS, 2, seed=7)
    nan.tensors[next(iter(nan.tensors))][0, 0] = float("nan")
    cat.put_revision("acme/nan", save_revision(nan, check=False))
    big = make_weights(SPECS, 2, seed=8)
    big.tensors[next(n for n in big.tensors if n.endswith("lora_B"))].fill_(1e30)
    cat.put_revision("acme/big", save_revision(big, check=False))
    cat.put_revision("acme/foreign", save_revision(make_weights(SPECS, 2, fingerprint="fp-other")))
    yield cat
    cat.close()


@pytest.mark.parametrize("owner_decodes", [False, True], ids=["worker-decodes", "owner-decodes"])
def test_a_pager_with_slabs_keeps_every_page_in_check(catalog, owner_decodes):
    """Non-finite values, factors past the bound and another base's revision fail their own
    fetch; the rest arrive as slabs holding exactly their adapter."""
    pool = AdapterPool(SPECS, PoolConfig(max_slots=16, max_rank=4))
    with Pager(catalog, CpuCache(1 << 24), FINGERPRINT, workers=1, batch=16) as pager:
        pager.slabs = Slabs.for_pool(pool)
        if owner_decodes:
            pager.decode_on_owner(lambda: None)
        good = [catalog.resolve(f"acme/s{i}") for i in range(8)]
        foreign = dataclasses.replace(catalog.resolve("acme/foreign"), base_fingerprint=FINGERPRINT)
        bad = {"acme/nan@r1": (CorruptBlob, "NaN or Inf"), "acme/big@r1": (FactorsTooLarge, "overflow|gain"),
               foreign.ref: (BaseMismatch, "fp-other")}
        futures = {r.ref: pager.fetch(r) for r in [*good, catalog.resolve("acme/nan"),
                                                   catalog.resolve("acme/big"), foreign]}
        for ref, (error, match) in bad.items():
            with pytest.raises(error, match=match):
                pager.wait(futures[ref])
        for i, record in enumerate(good):
            entry = pager.wait(futures[record.ref])
            assert isinstance(entry, SlabWeights) and record_key(record) in pager.cpu_cache
            back = read_back(pool, pool.load(record_key(record), entry))
            want = adapter(i).tensors
            assert back.keys() == want.keys()
            assert all(torch.equal(back[n], t.float()) for n, t in want.items())
