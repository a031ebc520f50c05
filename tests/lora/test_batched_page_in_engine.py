"""Batched page-ins through the engine: when several cold adapters are paged in in one batch and
one of their blobs fails its checksum, only that adapter's requests fail (with CorruptBlob); every
other request finishes with exactly the output of a run on an undamaged catalog."""
from __future__ import annotations

import dataclasses
import shutil
import threading

from loraserve.catalog.errors import CorruptBlob
from loraserve.catalog.layout import load_revision, save_revision
from loraserve.catalog.store import Catalog
from loraserve.engine.core.build import build_engine
from loraserve.engine.config import EngineConfig
from loraserve.engine.types import GenerateRequest, SamplingParams

from .driving import drive

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
COLD = [f"t/cold{i}" for i in range(6)]
BAD = "t/cold3"
WAIT = 30


def _catalog(dense_set, dst):
    """A copy of the session catalog plus COLD: distinct adapters (B scaled per adapter)."""
    shutil.copytree(dense_set.catalog, dst)
    with Catalog.open(dst) as cat:
        weights = load_revision(cat.read_blob(cat.resolve("t/all-r8-rslora")))
        for i, aid in enumerate(COLD):
            tensors = {n: t * (0.5 + 0.25 * i) if n.endswith("lora_B") else t for n, t in weights.tensors.items()}
            cat.put_revision(aid, save_revision(dataclasses.replace(weights, tensors=tensors)))
    return dst


def _corrupt(cat_dir, adapter_id: str) -> None:
    """Flip one data byte of the adapter's stored blob; its record and checksum stay."""
    with Catalog.open(cat_dir) as cat:
        record = cat.resolve(adapter_id)
        blob = bytearray(cat.read_blob(record))
        blob[-5] ^= 0xFF
        cat.shard(cat.shard_index(adapter_id)).write(
            lambda txn, dbs: txn.put(record.ref.encode(), bytes(blob), db=dbs.blob))


def _requests(vocab: int) -> list[GenerateRequest]:
    reqs = [GenerateRequest("base", [3, 1, 4, 1], GREEDY, None)]
    for i, aid in enumerate(COLD):
        for j in range(2):
            prompt = [(11 * i + 5 * j + k) % vocab for k in range(3 + j)]
            reqs.append(GenerateRequest(f"{aid}#{j}", prompt, GREEDY, aid))
    return reqs


def _serve(cat_dir, base, gate: threading.Event | None = None):
    """Each request's (token ids, error); with `gate`, the first blob read waits until every
    request is queued, so the other cold adapters are read together in the next batch."""
    eng = build_engine(EngineConfig(model_dir=str(base), catalog_dir=str(cat_dir), device="cpu", dtype="float32",
                                    max_model_len=64, max_batch_size=16, max_gpu_adapters=8, max_lora_rank=16,
                                    lora_backend="torch", pager_workers=1, pager_batch=16))
    batches = []
    real_read = eng.adapters.catalog.read_blobs

    def recorded_read(records):
        batches.append([r.adapter_id for r in records])
        if gate is not None:
            assert gate.wait(WAIT)
        return real_read(records)

    eng.adapters.catalog.read_blobs = recorded_read
    try:
        got = drive(eng, _requests(eng.vocab_size), after_add=gate.set if gate is not None else None)
        return got, batches, eng.adapters.pager.stats
    finally:
        eng.adapters.close()


def test_a_corrupt_blob_in_a_batch_fails_only_its_own_requests(dense_set, tmp_path):
    clean_dir = _catalog(dense_set, tmp_path / "clean")
    damaged_dir = tmp_path / "damaged"
    shutil.copytree(clean_dir, damaged_dir)
    _corrupt(damaged_dir, BAD)

    clean, _, _ = _serve(clean_dir, dense_set.base)
    damaged, batches, stats = _serve(damaged_dir, dense_set.base, gate=threading.Event())

    assert any(BAD in batch and len(batch) > 1 for batch in batches), batches  # read in a batch
    assert stats.load_errors == 1 and stats.disk_reads == len(COLD)
    for rid, (tokens, error) in damaged.items():
        if rid.startswith(BAD + "#"):
            assert isinstance(error, CorruptBlob) and "checksum" in str(error), (rid, error)
            assert tokens == []
        else:
            assert error is None and clean[rid][1] is None, (rid, error)
            assert tokens == clean[rid][0] and len(tokens) == GREEDY.max_tokens, rid
    outputs = {tuple(damaged[f"{aid}#0"][0]) for aid in COLD if aid != BAD}
    assert len(outputs) > 1  # the cold adapters really differ, so equality above means something
