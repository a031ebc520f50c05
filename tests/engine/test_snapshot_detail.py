"""The engine snapshot's detail (`snapshot.DETAIL_FIELDS`: which revisions each tier holds, the
tiers' counters, the page-in histogram) is read at most every DETAIL_EVERY_S while the engine
steps, and carried over (the same objects) in between; a forced publish (the engine idle, an
operator call returning) always reads it. A cold workload spent ~0.4 ms of the engine thread on
each publish reading it (bench/RESULTS.md, session 19)."""
from __future__ import annotations

import dataclasses

import pytest

from loraserve.demo import build_demo
from loraserve.engine.config import EngineConfig
from loraserve.engine.core import llm_engine
from loraserve.engine.core.build import build_engine
from loraserve.engine.snapshot import DETAIL_FIELDS
from loraserve.engine.types import SamplingParams
from loraserve.engine.wire import snapshot_from_wire, snapshot_has_detail, snapshot_to_wire
from loraserve.adapters.stats import CacheStats, PagerStats, PoolStats


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    demo = build_demo(tmp_path_factory.mktemp("snapshot-detail") / "demo")
    return build_engine(EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog),
                                     device="cpu", max_model_len=64, torch_threads=1, compile="off"))


def _run(engine, adapter: str) -> None:
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), [adapter])


def _aged(engine, seconds: float) -> None:
    """Make the last publish and detail read `seconds` old."""
    snap = engine.snapshot
    engine.snapshot = dataclasses.replace(snap, published=snap.published - seconds,
                                          detail_at=snap.detail_at - seconds)


def test_a_busy_publish_carries_the_detail_over_and_an_idle_one_reads_it(engine) -> None:
    _run(engine, "demo/pirate")
    idle = engine.snapshot  # the engine went idle: a forced publish, its detail read then
    assert idle.detail_at == idle.published
    assert any(aid == "demo/pirate" for aid, _ in idle.resident)
    assert any(aid == "demo/pirate" for aid, _ in idle.cpu_resident)
    _aged(engine, llm_engine.PUBLISH_EVERY_S)  # a publish is due, the detail is not
    idle = engine.snapshot
    engine.publish(force=False)
    busy = engine.snapshot
    assert busy is not idle and busy.published > busy.detail_at
    for name in DETAIL_FIELDS:  # the same objects: nothing read, nothing to send again
        assert getattr(busy, name) is getattr(idle, name)
    _aged(engine, llm_engine.DETAIL_EVERY_S)  # now the detail is due too
    engine.publish(force=False)
    assert engine.snapshot.detail_at == engine.snapshot.published
    assert engine.snapshot.resident == idle.resident
    engine.publish(force=True)  # forced: read whatever its age
    assert engine.snapshot.detail_at == engine.snapshot.published


def test_the_detail_that_was_carried_over_is_the_last_one_read(engine) -> None:
    """A page-in while busy shows once the detail is read again, not before."""
    engine.publish(force=True)
    before = engine.snapshot
    _run(engine, "demo/pirate")
    engine.snapshot = before  # as if the request's own publishes had not happened
    _aged(engine, llm_engine.PUBLISH_EVERY_S)
    engine.publish(force=False)
    assert engine.snapshot.pool == before.pool  # carried over: the counters as they were
    engine.publish(force=True)
    assert engine.snapshot.pool != before.pool  # read again: the request's page-in and use


def test_a_snapshot_without_its_detail_round_trips_to_the_receivers_own(engine) -> None:
    _run(engine, "demo/pirate")
    snap = engine.snapshot
    full, light = snapshot_to_wire(snap), snapshot_to_wire(snap, detail=False)
    assert snapshot_has_detail(full) and not snapshot_has_detail(light)
    assert not set(DETAIL_FIELDS) & set(light)
    back = snapshot_from_wire(full, PoolStats, CacheStats, PagerStats)
    assert back == snap
    bare = snapshot_from_wire(light, PoolStats, CacheStats, PagerStats)
    assert bare.resident == frozenset() and bare.pool is None
    assert bare.with_detail_of(back) == snap
