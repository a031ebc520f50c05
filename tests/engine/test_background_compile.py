"""The CPU decode step compiles in the background (engine.core.background_compile): the engine
serves eagerly from the first request, each bucket is admitted once made and measured, a step
never waits for the compile, the compiled steps give what the eager ones give, and the progress
is visible in the snapshot, on /ready and on /metrics. No timing is asserted: where a test
needs a bucket admitted, the measurement is replaced by a verdict."""
from __future__ import annotations

import dataclasses
import json
import time

import httpx
import pytest

from loraserve.adapters.stats import CacheStats, PagerStats, PoolStats
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core import background_compile as bc
from loraserve.engine.core.build import build_engine
from loraserve.engine.core.decode_graphs import DecodeGraphs, read_choice
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import SamplingParams
from loraserve.engine.wire import snapshot_from_wire, snapshot_to_wire
from loraserve.server import build_app
from loraserve.server.router_metrics import decode_buckets
from server.live import LiveServer

PROMPTS = [[5, 9, 14, 3], [7, 2, 8]]
TOKENS = 8


@pytest.fixture()
def caches(tmp_path, monkeypatch):
    """Choices and compiled code of this test only (the inductor directory is read per compile)."""
    monkeypatch.setenv("LORASERVE_COMPILE_CACHE", str(tmp_path / "choices.json"))
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path


def _cfg(base, **kw) -> EngineConfig:
    return EngineConfig(model_dir=str(base), device="cpu", dtype="float32", max_model_len=64,
                        max_batch_size=2, compile_batch_sizes=[2], **kw)


def _greedy(engine) -> list[list[int]]:
    return engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))


def _finish(engine, timeout_s: float = 600.0) -> None:
    """Step the idle engine (as its owner loop does when woken) until the compile is done."""
    deadline = time.monotonic() + timeout_s
    while not engine.compiler.done or engine.compiler._unmeasured:
        assert time.monotonic() < deadline, engine.compiler.progress()
        engine.step()
        time.sleep(0.05)


def test_serves_at_once_then_through_the_graphs_with_the_same_tokens(demo_dense, caches, monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "measure", lambda self, b, reps=5: True)  # the verdict: faster
    eager = build_engine(_cfg(demo_dense, compile="off"))
    want = _greedy(eager)
    engine = build_engine(_cfg(demo_dense, compile="on"))
    graphs, compiler = engine.runner.graphs, engine.compiler
    assert graphs is not None and compiler is not None
    assert graphs.model is not engine.model  # the twin: its own module tree over the same weights
    assert graphs.model.model.embed_tokens.weight is engine.model.model.embed_tokens.weight
    # served before any graph is made, eagerly, with the same tokens
    with graphs.lock:  # the compile thread cannot make a graph meanwhile
        assert not graphs.ready and graphs.bucket(2, 10) is None  # admitted once measured
        before = graphs.steps  # (the compile thread's own steps count too)
        assert _greedy(engine) == want and graphs.steps == before
    _finish(engine)
    assert compiler.error is None and dict(compiler.progress()) == {"batch2": "compiled"}
    assert graphs.ready == {(2, False)}
    before = graphs.steps
    assert _greedy(engine) == want
    assert graphs.steps - before >= TOKENS - 1  # the decode steps ran through the graph
    engine.publish()
    assert engine.snapshot.compile == (("batch2", "compiled"),) and engine.snapshot.compiling() == []


def test_a_step_never_waits_for_the_compile(demo_dense, caches, monkeypatch):
    """While the compile thread holds the graphs (making one), a step that fits a made bucket
    runs eagerly instead of waiting: same tokens, no graph step."""
    monkeypatch.setattr(DecodeGraphs, "measure", lambda self, b, reps=5: True)
    engine = build_engine(_cfg(demo_dense, compile="on"))
    _finish(engine)
    graphs = engine.runner.graphs
    want = _greedy(engine)
    with graphs.lock:
        before = graphs.steps
        assert _greedy(engine) == want and graphs.steps == before


def test_a_bucket_measured_no_faster_stays_eager_and_is_remembered(demo_dense, caches, monkeypatch):
    def slower(self, b, reps=5):
        self.timings[b] = (0.001, 0.002)
        self.eager_batches.add(b)
        return False

    monkeypatch.setattr(DecodeGraphs, "measure", slower)
    cfg = _cfg(demo_dense, compile="auto")
    engine = build_engine(dataclasses.replace(cfg, compile="on"))
    _finish(engine)
    assert dict(engine.compiler.progress()) == {"batch2": "eager"} and not engine.runner.graphs.ready
    before = engine.runner.graphs.steps
    _greedy(engine)
    assert engine.runner.graphs.steps == before
    # `on` measures every start, and records it; `auto` then compiles nothing for this shape
    keys = json.loads((caches / "choices.json").read_text())
    assert [read_choice(caches / "choices.json", k) for k in keys] == [{2}]
    again = build_engine(cfg)
    assert again.runner.graphs is None and again.compiler is None


def test_the_compile_thread_yields_to_a_busy_engine(monkeypatch):
    """The throttle sleeps while the engine has work and lets the compile run while it has none
    (checked every 1024 profile events)."""
    slept = []
    monkeypatch.setattr(bc.time, "sleep", slept.append)
    busy = [True]
    graphs = type("G", (), {"batch_sizes": (1,), "variants": lambda self, b: (False,)})()
    compiler = bc.BackgroundCompile(graphs, is_idle=lambda: not busy[0])
    for _ in range(4096):
        compiler._throttle(None, "call", None)
    assert slept and all(s == bc.THROTTLE_PAUSE_S for s in slept)
    slept.clear()
    busy[0] = False
    compiler._run_until = 0.0
    for _ in range(4096):
        compiler._throttle(None, "call", None)
    assert slept == []


def test_progress_travels_to_ready_and_metrics(demo_dense, caches):
    """The snapshot's progress crosses the engine-core wire; /ready answers 200 while buckets
    compile and lists them; loraserve_decode_buckets counts them by state."""
    snap = EngineSnapshot(compile=(("batch1", "compiled"), ("batch2", "compiling"), ("batch4", "pending")))
    back = snapshot_from_wire(snapshot_to_wire(snap), PoolStats, CacheStats, PagerStats)
    assert back.compile == snap.compile and back.compiling() == ["batch2", "batch4"]
    metric = decode_buckets([({}, back)])
    counts = {s.labels["state"]: s.value for s in metric.samples}
    assert counts["compiled"] == 1 and counts["compiling"] == 1 and counts["pending"] == 1
    assert counts["eager"] == counts["failed"] == 0

    engine = AsyncEngine.from_model_dir(str(demo_dense), device="cpu", dtype="float32",
                                        max_model_len=64, max_batch_size=2, compile="on",
                                        compile_batch_sizes=[2])
    with LiveServer(build_app(engine)) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        body, deadline = http.get("/ready").json(), time.monotonic() + 60
        while set(body) == {"status"} and time.monotonic() < deadline:  # the loop's first snapshot
            time.sleep(0.1)                                              # is not published yet
            body = http.get("/ready").json()
        assert body["status"] == "ready" and set(body) == {"status", "compiling", "compiled"}
        r = http.post("/v1/completions", json={"model": engine.model_name, "prompt": [5, 9, 14],
                                               "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 600
        while http.get("/ready").json().get("compiling"):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        body = http.get("/ready").json()
        text = http.get("/metrics").text
        states = {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith("loraserve_decode_buckets{")}
        assert sum(states.values()) == 1 and states["compiled"] + states["eager"] == 1
        assert body["compiled"] == (["batch2"] if states["compiled"] else [])
