"""vLLM's router-facing gauges on the single-process server (demo base and catalog, CPU): the
names a Kubernetes endpoint picker reads, their values, the adapter names exactly as clients
asked for them, and a scrape that stays cheap."""
from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.demo import DemoPaths, build_demo
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.server import build_app
from loraserve.server.router_metrics import RouterMetricsCollector

from .live import LiveServer

ROUTER_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    """The run's shared demo (built once under a lock, as tests/test_demo.py does)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    with open(base / "loraserve-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_demo(base / "loraserve-demo")


@pytest.fixture(scope="module")
def engine(demo: DemoPaths) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(
        model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), catalog_readonly=True,
        device="cpu", max_model_len=256, max_batch_size=4, block_size=8, max_gpu_adapters=2,
        torch_threads=1))


@pytest.fixture(scope="module")
def app(engine: AsyncEngine):
    return build_app(engine)


@pytest.fixture(scope="module")
def http(app) -> Iterator[httpx.Client]:
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def one(samples: list, name: str):
    found = [s for s in samples if s.name == name]
    assert len(found) == 1, found
    return found[0]


def test_router_gauges_are_exported_under_vllm_names(http, engine) -> None:
    fams = families(http.get("/metrics").text)
    for name in ROUTER_GAUGES:
        s = one(fams[name], name)
        assert s.labels == {"model_name": engine.model_name} and s.value == 0.0
    cache = one(fams["vllm:cache_config_info"], "vllm:cache_config_info")
    assert cache.labels == {"block_size": "8", "num_gpu_blocks": str(engine.transport.engine.blocks.num_blocks)}
    lora = one(fams["vllm:lora_requests_info"], "vllm:lora_requests_info")
    assert lora.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
    assert abs(lora.value - time.time()) < 60  # vLLM's convention: the newest series wins


def test_running_adapter_shows_the_name_the_client_sent(http) -> None:
    body = {"model": "demo/pirate@r1", "messages": [{"role": "user", "content": "Who are you?"}],
            "max_tokens": 220, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for _ in range(200):  # the engine republishes its snapshot every 10 ms while it steps
            fams = families(http.get("/metrics").text)
            if one(fams["vllm:num_requests_running"], "vllm:num_requests_running").value == 1.0:
                break
        lora = one(fams["vllm:lora_requests_info"], "vllm:lora_requests_info")
    assert lora.labels["running_lora_adapters"] == "demo/pirate@r1", lora.labels


def test_parked_requests_count_as_waiting() -> None:
    """A sequence waiting for its adapter to page in is waiting to a router."""
    engine = type("E", (), {"model_name": "m", "config": EngineConfig(model_dir="m"),
                            "replica_snapshots": lambda self: None,  # one engine
                            "snapshot": EngineSnapshot(waiting=2, parked=3, running=1,
                                                       waiting_adapters=("t/a", "t/b@r2"))})()
    fams = {m.name: m.samples for m in RouterMetricsCollector(engine).collect()}
    assert one(fams["vllm:num_requests_waiting"], "vllm:num_requests_waiting").value == 5
    assert one(fams["vllm:lora_requests_info"], "vllm:lora_requests_info").labels[
        "waiting_lora_adapters"] == "t/a,t/b@r2"


def test_sequences_keep_the_name_as_asked(engine) -> None:
    """make_sequence keeps the ref (`@r1` included) beside the adapter key; base: no name."""
    eng = engine.transport.engine
    req = GenerateRequest("names-1", [1, 2, 3], SamplingParams(max_tokens=1), "demo/poet@r1")
    seq = eng.make_sequence(req, eng.resolve_adapter(req.adapter))
    assert seq.adapter_ref == "demo/poet@r1" and seq.adapter_key == ("demo/poet", "r1")
    assert eng.make_sequence(GenerateRequest("names-2", [1], SamplingParams(max_tokens=1))).adapter_ref is None


class _Reads:
    """The engine, recording the names a scrape reads off it."""

    def __init__(self, engine):
        self._engine, self.names = engine, []

    def __getattr__(self, name):
        self.names.append(name)
        return getattr(self._engine, name)


def test_a_scrape_reads_published_snapshots_only(http, app, engine) -> None:
    """A scrape costs no engine work: the collectors read the snapshot the engine published
    (and names and config fixed at start-up), never a call into the engine loop, and render
    reads only the stats handed to it. (What it costs in time is bench work, not a test's.)"""
    assert http.get("/metrics").status_code == 200
    reads = _Reads(engine)
    assert list(RouterMetricsCollector(reads).collect())
    assert set(reads.names) <= {"replica_snapshots", "snapshot", "model_name", "config"}, reads.names
    stats = engine.stats()
    text = app.state.ctx.metrics.render(stats).decode()
    assert "vllm:num_requests_running" in text and "loraserve_" in text
