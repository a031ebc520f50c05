"""`loraserve loadtest` against a tiny in-process stub server (FastAPI + uvicorn on an ephemeral port)."""
import argparse
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from loraserve.loadtest import (LoadTestConfig, add_subcommand, format_report, list_catalog_adapters,
                                read_adapter_file, run_loadtest)

TOKENS = 3


def stub_app(seen: list[dict]) -> FastAPI:
    """Streams TOKENS one-word chunks; `missing/*` models are 404; counts a gpu hit per request
    (a miss for `cold/*`) and a cpu hit per 2 requests on /metrics."""
    app = FastAPI()
    counts = {"gpu_hits": 0, "gpu_misses": 0, "cpu_hits": 0}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        model = body.get("adapter") or body["model"]
        if model.startswith("missing/"):
            return JSONResponse({"error": {"message": "no such adapter", "type": "not_found",
                                           "param": "model", "code": 404}}, status_code=404)
        counts["gpu_misses" if model.startswith("cold/") else "gpu_hits"] += 1
        counts["cpu_hits"] += len(seen) % 2

        async def events():
            for i in range(TOKENS):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}], "usage": None}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": TOKENS}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-base"}, {"id": "acme/a"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE loraserve_adapter_hits_total counter\n"
            f'loraserve_adapter_hits_total{{tier="gpu"}} {counts["gpu_hits"]}\n'
            f'loraserve_adapter_hits_total{{tier="cpu"}} {counts["cpu_hits"]}\n'
            "# TYPE loraserve_adapter_misses_total counter\n"
            f'loraserve_adapter_misses_total{{tier="gpu"}} {counts["gpu_misses"]}\n'
            'loraserve_adapter_misses_total{tier="cpu"} 0\n')

    return app


@pytest.fixture
def stub():
    """(base url, list of received request bodies) of a stub server on 127.0.0.1, ephemeral port."""
    seen: list[dict] = []
    server = uvicorn.Server(uvicorn.Config(stub_app(seen), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "stub server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def config(url: str, **kw) -> LoadTestConfig:
    kw.setdefault("concurrency", 3)
    return LoadTestConfig(url=url, duration=30, progress=False, prompt_len=4, max_tokens=3, **kw)


def test_closed_loop_counts_tokens_latencies_and_hit_rates(stub):
    url, seen = stub
    report = run_loadtest(config(url, adapters=["acme/a", "cold/b"], max_requests=12, dist="zipf:1.2"))
    assert (report["requests"], report["ok"], report["errors"]) == (12, 12, 0)
    assert report["output_tokens"] == 12 * TOKENS and report["output_tokens_per_s"] > 0
    for key in ("ttft_s", "e2e_s"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert report["ttft_s"]["p50"] <= report["e2e_s"]["p99"]
    cold = sum(b["model"] == "cold/b" for b in seen)
    assert report["adapter_hit_rate"]["gpu"] == pytest.approx((12 - cold) / 12)
    assert 0 <= report["adapter_hit_rate"]["cpu"] <= 1
    assert all(b["stream"] and b["max_tokens"] == 3 and len(b["prompt"].split()) == 4 for b in seen)


def test_open_loop_and_errors_by_kind(stub):
    url, seen = stub
    report = run_loadtest(config(url, concurrency=None, rate=200.0, adapters=["acme/a", "missing/x"],
                                 max_requests=10, seed=3))
    bad = sum(b["model"] == "missing/x" for b in seen)
    assert report["mode"] == "open" and report["requests"] == 10
    assert report["errors"] == bad and report["error_kinds"] == ({"http 404": bad} if bad else {})
    assert report["ok"] == 10 - bad


def test_model_field_and_base_model_from_the_server(stub):
    url, seen = stub
    run_loadtest(config(url, adapters=["acme/a"], model_field="adapter", max_requests=2))
    run_loadtest(config(url, max_requests=2))
    assert [(b["model"], b.get("adapter")) for b in seen] == [("tiny-base", "acme/a")] * 2 + [("tiny-base", None)] * 2


def test_zipf_favours_the_first_adapter(stub):
    url, seen = stub
    adapters = [f"acme/a{i}" for i in range(20)]
    run_loadtest(config(url, adapters=adapters, dist="zipf:2", max_requests=60, concurrency=6))
    first = sum(b["model"] == "acme/a0" for b in seen)
    assert first > 60 / 20 * 3  # p(a0) ~ 0.61 under zipf:2 over 20 adapters


def test_cli_prints_a_table_and_writes_json(stub, tmp_path, capsys):
    url, _ = stub
    ids = tmp_path / "ids.txt"
    ids.write_text("# adapters\nacme/a\n\ncold/b  # a cold one\n")
    assert read_adapter_file(ids) == ["acme/a", "cold/b"]
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    out = tmp_path / "report.json"
    args = parser.parse_args(["loadtest", "--url", url, "--adapters", str(ids), "--requests", "5",
                              "--concurrency", "2", "--max-tokens", "3", "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "ok 5" in text and "ttft" in text and "adapter hit rate: cpu" in text
    report = json.loads(out.read_text())
    assert report["ok"] == 5 and report["config"]["adapters"] == 2 and "api_key" not in report["config"]
    assert format_report(report).splitlines()[0].startswith(f"loadtest {url}")


def test_cli_reports_failure_when_nothing_succeeds(stub, tmp_path):
    url, _ = stub
    ids = tmp_path / "ids.txt"
    ids.write_text("missing/x\n")
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["loadtest", "--url", url, "--adapters", str(ids), "--requests", "2", "--no-progress"])
    with pytest.raises(RuntimeError, match="no request succeeded.*http 404"):
        args.func(args)


def test_adapters_listed_from_a_real_catalog(tmp_path):
    from loraserve.catalog.layout import AdapterWeights, save_revision
    from loraserve.catalog.store import Catalog
    import torch

    weights = AdapterWeights("fp", 1, ["q_proj"], torch.float32, {
        "layers.0.self_attn.q_proj.lora_A": torch.zeros(1, 4),
        "layers.0.self_attn.q_proj.lora_B": torch.zeros(4, 1)})
    with Catalog.create(tmp_path / "cat", shards=3) as cat:
        for name in ("b", "a", "c"):
            cat.put_revision(f"acme/{name}", save_revision(weights))
        cat.put_revision("acme/unpromoted", save_revision(weights), promote=False)
    assert list_catalog_adapters(tmp_path / "cat", limit=10) == ["acme/a", "acme/b", "acme/c"]


@pytest.mark.parametrize("kw, message", [
    ({"url": "localhost:8000"}, "http://"),
    ({"rate": 5.0}, "exactly one"),
    ({"concurrency": None}, "exactly one"),
    ({"dist": "zipf"}, "zipf:S"),
    ({"dist": "zipf:-1"}, "zipf:S"),
    ({"duration": 0}, "positive"),
    ({"max_requests": 0}, "max-requests"),
])
def test_bad_config_is_refused(kw, message):
    args = {"url": "http://127.0.0.1:1", "concurrency": 2, **kw}
    with pytest.raises(ValueError, match=message):
        LoadTestConfig(**args)
