"""Adapter-aware scheduling through the real engine: no head-of-line blocking on a miss, revision
pinning across a promote, and a random workload that never breaks a residency bound."""
from __future__ import annotations

import random
import shutil
import threading

from loraserve.catalog.importer import import_peft
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.sequence import SeqStatus
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.engine.core.build import build_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(base, catalog, **kw):
    return build_engine(EngineConfig(model_dir=str(base), catalog_dir=str(catalog), device="cpu", dtype="float32",
                                     max_model_len=96, max_lora_rank=16, **kw))


def _copy_catalog(dense_set, tmp_path):
    dst = tmp_path / "catalog"
    shutil.copytree(dense_set.catalog, dst)
    return dst


def test_a_miss_parks_its_request_and_resident_ones_keep_decoding(dense_set, tmp_path):
    eng = _engine(dense_set.base, _copy_catalog(dense_set, tmp_path), max_gpu_adapters=4)
    gate = threading.Event()
    real_read = eng.adapters.catalog.read_blobs

    def slow_read(records):
        gate.wait(30)
        return real_read(records)

    eng.generate([[5, 6, 7]], GREEDY, ["t/qv-r4"])  # t/qv-r4 now resident
    eng.adapters.catalog.read_blobs = slow_read
    missing = eng.add_request(GenerateRequest("miss", [5, 6, 7], GREEDY, "t/all-r8-rslora"))
    resident = eng.add_request(GenerateRequest("hit", [8, 9], GREEDY, "t/qv-r4"))
    base = eng.add_request(GenerateRequest("base", [10, 11], GREEDY, None))
    for _ in range(20):
        eng.step()
    assert missing.status is SeqStatus.PARKED
    assert resident.is_finished and base.is_finished and len(resident.output_ids) == 6
    gate.set()
    while eng.has_work():
        eng.step()
    assert missing.is_finished and len(missing.output_ids) == 6


def test_a_request_in_flight_keeps_its_revision_across_a_promote(dense_set, tmp_path):
    cat_dir = _copy_catalog(dense_set, tmp_path)
    eng = _engine(dense_set.base, cat_dir, max_gpu_adapters=4)
    prompt = [12, 40, 7, 99]
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = eng.generate([prompt], long, ["t/qv-r4"])[0]
    seq = eng.add_request(GenerateRequest("flight", prompt, long, "t/qv-r4"))
    for _ in range(4):
        eng.step()
    # a new revision (other weights) is promoted mid-flight (LMDB allows one env per process:
    # write through the engine's own catalog handle)
    rec = import_peft(eng.adapters.catalog, "t/qv-r4", dense_set.peft_dirs["t/all-r8-rslora"], dense_set.base,
                      promote=True)
    assert rec.revision == "r2"
    while eng.has_work():
        eng.step()
    assert seq.adapter_key == ("t/qv-r4", "r1") and seq.output_ids == before
    after = eng.generate([prompt], long, ["t/qv-r4"])[0]
    assert after == eng.generate([prompt], long, ["t/all-r8-rslora"])[0] != before


def test_random_workload_never_exceeds_bounds_or_evicts_in_use(dense_set, tmp_path):
    eng = _engine(dense_set.base, _copy_catalog(dense_set, tmp_path), max_gpu_adapters=2, max_batch_size=6,
                  cpu_cache_mb=1, block_size=4)
    pool, rng = eng.adapters.pool, random.Random(0)
    choices = ["t/qv-r4", "t/all-r8-rslora", "t/o-head-r2", None]
    stems = [[rng.randrange(3, 250) for _ in range(12)] for _ in range(3)]  # shared prefixes
    live: list[str] = []
    for step in range(160):
        if rng.random() < 0.35:
            rid = f"w{step}"
            prompt = rng.choice(stems)[: rng.randint(1, 12)] + [rng.randrange(3, 250)]
            p = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]), seed=step)
            eng.add_request(GenerateRequest(rid, prompt, p, rng.choice(choices)))
            live.append(rid)
        if live and rng.random() < 0.05:
            eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()
        pool.check_invariants()
        eng.blocks.check_invariants(eng.scheduler.running)  # KV blocks and prefix cache too
        assert len(pool.resident()) <= 2
        assert pool.stats.bytes_used <= pool.bytes_capacity
        assert eng.adapters.cpu_cache.stats.bytes <= 2**20
        in_use: dict = {}
        for seq in eng.scheduler.running:
            if seq.adapter_key is not None:
                assert pool.entry(seq.adapter_key).slot == seq.slot  # its adapter was never evicted
                in_use[seq.adapter_key] = in_use.get(seq.adapter_key, 0) + 1
        for key, n in in_use.items():
            assert pool.entry(key).refcount == n
    while eng.has_work():
        eng.step()
    assert all(pool.entry(k).refcount == 0 for k in pool.resident())
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.blocks.prefix_hit_tokens > 0


def test_pinned_adapter_stays_resident_under_pressure(dense_set, tmp_path):
    eng = _engine(dense_set.base, _copy_catalog(dense_set, tmp_path), max_gpu_adapters=2,
                  pinned_adapters=["t/o-head-r2"])
    pool = eng.adapters.pool
    assert pool.is_pinned(("t/o-head-r2", "r1"))
    for adapter in ["t/qv-r4", "t/all-r8-rslora", "t/qv-r4", "t/all-r8-rslora"]:
        assert len(eng.generate([[5, 6, 7]], GREEDY, [adapter])[0]) == GREEDY.max_tokens
        assert ("t/o-head-r2", "r1") in pool and len(pool.resident()) <= 2
    assert pool.stats.evictions >= 2  # the other two took turns in the one unpinned slot
