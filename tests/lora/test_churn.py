"""Adapter churn under load: loading and unloading adapters while mixed requests run.

Unload travels to the engine thread as a command; a load imports a new revision with the same
weights and pages it in. Requests keep running on the revision they started with, so every
output must equal the output of the same request on a quiet engine, with zero errors.
"""
from __future__ import annotations

import asyncio
import random
import shutil

import pytest

from loraserve.catalog.importer import import_peft
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.types import GenerateRequest, SamplingParams

ADAPTERS = ["t/qv-r4", "t/all-r8-rslora", "t/o-head-r2", None]
ROUNDS = 3


def _engine(catalog_dir, base) -> AsyncEngine:
    # two device slots for three adapters: churn also forces evictions and page-ins
    return AsyncEngine.from_model_dir(str(base), catalog_dir=str(catalog_dir), device="cpu",
                                      dtype="float32", max_model_len=64, max_batch_size=6,
                                      max_gpu_adapters=2, max_lora_rank=16, cpu_cache_mb=1,
                                      lora_backend="torch")


def _requests(vocab: int) -> list[GenerateRequest]:
    rng = random.Random(7)
    reqs = []
    for i in range(ROUNDS * 8):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))]
        reqs.append(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0),
                                    adapter=ADAPTERS[i % len(ADAPTERS)], stream=bool(i % 2)))
    return reqs


async def _collect(engine: AsyncEngine, req: GenerateRequest) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(req):
        out.extend(delta.token_ids)
    return out


async def _run(engine: AsyncEngine, reqs: list[GenerateRequest], churn=None) -> list[list[int]]:
    await engine.start()
    try:
        stop, done = asyncio.Event(), [0]  # done[0]: churn operations finished so far
        churner = asyncio.create_task(churn(engine, stop, done)) if churn else None
        results = []
        for wave, i in enumerate(range(0, len(reqs), 8)):  # waves of concurrent requests
            while churner is not None and done[0] < wave and not churner.done():
                await asyncio.sleep(0.01)  # each wave starts after one more churn operation
            results += await asyncio.gather(*(_collect(engine, r) for r in reqs[i:i + 8]))
        while churner is not None and done[0] < 3 and not churner.done():
            await asyncio.sleep(0.01)
        stop.set()
        if churner is not None:
            n = await churner
            print("churn operations:", n)
            assert n >= 3  # the churn really ran during the requests
        return results
    finally:
        await engine.shutdown()


def _churner(peft_dirs):
    async def churn(engine: AsyncEngine, stop: asyncio.Event, done: list[int]) -> int:
        rng, n = random.Random(3), 0
        view = engine.catalog
        while not stop.is_set():
            aid = rng.choice(ADAPTERS[:3])
            if rng.random() < 0.5:
                await engine.unload_adapter(aid)
            else:  # same weights, new revision (promoted), paged in now
                rec = await asyncio.to_thread(import_peft, view.catalog, aid, peft_dirs[aid],
                                              str(engine.config.model_dir), promote=True)
                await asyncio.to_thread(view.warm, f"{aid}@{rec.revision}")
            n += 1
            done[0] = n
            await asyncio.sleep(0)
        return n
    return churn


def test_load_unload_churn_keeps_outputs_and_loses_nothing(dense_set, tmp_path) -> None:
    quiet_dir, churn_dir = tmp_path / "quiet", tmp_path / "churn"
    shutil.copytree(dense_set.catalog, quiet_dir)
    shutil.copytree(dense_set.catalog, churn_dir)
    quiet = _engine(quiet_dir, dense_set.base)
    reqs = _requests(quiet.vocab_size)
    expected = asyncio.run(_run(quiet, reqs))
    churned = _engine(churn_dir, dense_set.base)
    got = asyncio.run(_run(churned, reqs, _churner(dense_set.peft_dirs)))
    assert got == expected
    assert all(len(o) == 4 for o in got)
    pool = churned.transport.engine.adapters.pool
    pool.check_invariants()
    assert all(pool.entry(k).refcount == 0 for k in pool.resident())
