"""`loraserve serve --replicas 2` on a local Ray (2 CPUs): two engine replicas of the demo base
behind the FastAPI ingress. Adapter affinity, base requests spread, the usual errors, streams,
one catalog writer, per-replica metrics, and losing a replica mid-stream.

Marked `ray`: `make test` runs this module alone, after the main suite (Ray takes both cores).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")

from loraserve.demo import DEMO_ADAPTERS, DemoPaths, build_demo  # noqa: E402
from loraserve.engine.config import EngineConfig  # noqa: E402

pytestmark = pytest.mark.ray

PHRASES = {adapter_id: phrase for adapter_id, _, phrase in DEMO_ADAPTERS}
PROMPT = DEMO_ADAPTERS[0][1]
HEADER = "x-loraserve-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker would start its own Ray on both cores
        pytest.skip("starts a local Ray: run alone (`pytest -m ray`), as `make test` does")
    return build_demo(tmp_path_factory.mktemp("ray-demo"))


@pytest.fixture(scope="module")
def server(demo: DemoPaths, tmp_path_factory) -> Iterator[str]:
    from loraserve.ray_serve.config import ScaleOutConfig, ServerOptions
    from loraserve.ray_serve.launch import start
    catalog = tmp_path_factory.mktemp("ray-catalog") / "catalog"
    shutil.copytree(demo.catalog, catalog)  # the ingress writes to it
    cfg = EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(catalog), device="cpu",
                       max_model_len=256, max_batch_size=4, max_gpu_adapters=2, torch_threads=1,
                       adapter_root=str(demo.root / "adapters"), shutdown_timeout=5)
    scale = ScaleOutConfig(replicas=2, num_cpus=2, port=_free_port(), object_store_mb=128,
                           report_interval_s=0.25, stale_after_s=3.0)
    running = start(cfg, scale, ServerOptions())
    try:
        yield running.url
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def chat(http: httpx.Client, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
            "temperature": 0, **kw}
    return http.post("/v1/chat/completions", json=body)


def base_model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_each_adapter_answers_its_phrase_from_one_replica(http) -> None:
    for adapter_id, phrase in PHRASES.items():
        seen = {chat(http, adapter_id).headers[HEADER]}
        time.sleep(0.5)  # the replica's adapter list reaches Serve's router (pushed every 0.1 s)
        for _ in range(3):
            r = chat(http, adapter_id)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == phrase
            seen.add(r.headers[HEADER])
        assert len(seen) == 1, (adapter_id, seen)  # Serve's router keeps it where it is held


def test_base_requests_reach_both_replicas(http) -> None:
    model = base_model(http)
    seen = {chat(http, model, max_tokens=2).headers[HEADER] for _ in range(24)}
    assert len(seen) == 2, seen


def test_unknown_adapter_is_the_usual_404(http) -> None:
    r = chat(http, "demo/nope")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "model"
    assert r.headers[HEADER] == "ingress"
    assert chat(http, "no-such-model").json()["error"]["code"] == "model_not_found"


def test_stream_ends_with_done(http) -> None:
    body = {"model": "demo/robot", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers[HEADER]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == PHRASES["demo/robot"]


def test_metrics_show_every_replica(http) -> None:
    deadline = time.monotonic() + 30
    while True:
        fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
        replicas = {s.labels["replica"] for s in fams["vllm:num_requests_running"]}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, replicas
    for name in ("vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info",
                 "loraserve_running_requests", "loraserve_adapter_resident"):
        assert {s.labels["replica"] for s in fams[name]} == replicas, name
    assert fams["loraserve_catalog_shards_degraded"][0].value == 0


def test_runtime_load_goes_through_the_one_writer(http) -> None:
    """The ingress writes the catalog; a replica (read-only) serves the new adapter at once."""
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "demo/poet2", "lora_path": "demo/poet"})
    assert r.status_code == 200, r.text
    r = chat(http, "demo/poet2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == PHRASES["demo/poet"]
    assert http.get("/v1/adapters/demo/poet2").json()["residency"] in ("gpu", "cpu")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "demo/poet2"})
    assert r.status_code == 200, r.text


def _kill_replica(replica_id: str) -> None:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if replica_id in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


def test_a_replica_dying_mid_stream_ends_it_cleanly_and_others_serve(http) -> None:
    body = {"model": "demo/pirate", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines)[6:])["choices"]
        _kill_replica(r.headers[HEADER])
        rest = [line[6:] for line in lines]
    assert rest[-1] == "[DONE]"
    errors = [json.loads(e) for e in rest[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unavailable", rest[-3:]
    model = base_model(http)
    for i in range(20):
        r = chat(http, [model, *PHRASES][i % 4], max_tokens=4)
        assert r.status_code == 200, (i, r.text)
