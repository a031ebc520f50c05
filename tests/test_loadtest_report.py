"""`loraserve loadtest --report`, the built-in HTTP client, the wrk driver (when installed) and the
memory series on /metrics, against small in-process servers on 127.0.0.1 (ephemeral ports)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from loraserve.loadgen import wrk as wrk_mod
from loraserve.loadgen.client import HTTPClient, ResponseTimeout
from loraserve.loadgen.report import SERIES_KEYS, cdf
from loraserve.loadgen.timeline import parse_kept
from loraserve.loadtest import LoadTestConfig, add_subcommand, run_loadtest

TOKENS = 2


def fake_server_app() -> FastAPI:
    """Streams TOKENS chunks; `missing/*` is 404, `slow/*` answers after 0.5 s. /metrics has the
    series the report draws, moving with the requests served."""
    app = FastAPI()
    state = {"n": 0, "cold": 0, "page_ins": 0}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        model = body["model"]
        if model.startswith("missing/"):
            return JSONResponse({"error": {"message": "no such adapter"}}, status_code=404)
        if model.startswith("slow/"):
            await asyncio.sleep(0.5)
        state["n"] += 1
        if model.startswith("cold/"):
            state["cold"] += 1
            state["page_ins"] += 1

        async def events():
            for i in range(TOKENS):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}], "usage": None}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": TOKENS}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-base"}]}

    @app.get("/metrics")
    async def metrics():
        n, cold = state["n"], state["cold"]
        return PlainTextResponse(
            "# TYPE loraserve_adapter_hits_total counter\n"
            f'loraserve_adapter_hits_total{{tier="gpu"}} {n - cold}\n'
            f'loraserve_adapter_hits_total{{tier="cpu"}} 0\n'
            "# TYPE loraserve_adapter_misses_total counter\n"
            f'loraserve_adapter_misses_total{{tier="gpu"}} {cold}\n'
            f'loraserve_adapter_misses_total{{tier="cpu"}} {cold}\n'
            "# TYPE loraserve_adapter_resident gauge\n"
            f'loraserve_adapter_resident{{tier="gpu"}} {min(n, 4)}\n'
            f'loraserve_adapter_resident{{tier="cpu"}} {min(n, 8)}\n'
            "# TYPE loraserve_adapter_resident_bytes gauge\n"
            f'loraserve_adapter_resident_bytes{{tier="gpu"}} {min(n, 4) * 1000}\n'
            "# TYPE loraserve_adapter_page_in_seconds histogram\n"
            f'loraserve_adapter_page_in_seconds_bucket{{source="disk",le="+Inf"}} {state["page_ins"]}\n'
            f'loraserve_adapter_page_in_seconds_count{{source="disk"}} {state["page_ins"]}\n'
            f'loraserve_adapter_page_in_seconds_sum{{source="disk"}} {state["page_ins"] * 0.003}\n'
            "# TYPE process_resident_memory_bytes gauge\n"
            f"process_resident_memory_bytes {100e6 + n}\n"
            "# TYPE loraserve_engine_core_rss_bytes gauge\n"
            f"loraserve_engine_core_rss_bytes {200e6 + n}\n")

    return app


class Served:
    def __init__(self, app: FastAPI, **config):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake_url():
    with Served(fake_server_app()) as url:
        yield url


REMOTE = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I)


def test_report_files_every_series_and_no_remote_reference(fake_url, tmp_path):
    out = tmp_path / "rep"
    report = run_loadtest(LoadTestConfig(
        url=fake_url, adapters=["acme/a", "cold/b", "missing/c"], rate=150.0, duration=1.2,
        max_requests=1000, prompt_len=4, max_tokens=TOKENS, progress=False, report_dir=str(out),
        scrape_interval=0.25))
    assert report["ok"] > 0 and report["error_kinds"].keys() == {"http 404"}
    page, summary = out / "report.html", out / "summary.json"
    assert page.is_file() and summary.is_file()
    data = json.loads(summary.read_text())
    assert data["ok"] == report["ok"] and set(data["series"]) == set(SERIES_KEYS)
    s = data["series"]
    assert sum(s["throughput"]["ok_per_s"]) * 0.25 == pytest.approx(report["ok"])
    assert sum(s["throughput"]["errors_per_s"]) * 0.25 == pytest.approx(report["errors"])
    assert s["errors_by_status"] == report["error_kinds"]
    for key in ("e2e_s", "ttft_s"):
        c = s["latency_cdf"][key]
        assert c["x"] == sorted(c["x"]) and c["p"][-1] == pytest.approx(1.0)
    assert set(s["hit_rate"]) == {"gpu", "cpu"} and set(s["resident_adapters"]) == {"gpu", "cpu"}
    assert len(s["resident_adapters"]["gpu"]["t"]) >= 3  # scraped during the run, not just at its ends
    assert set(s["page_ins_per_s"]) == {"disk"} and max(s["page_ins_per_s"]["disk"]["value"]) > 0
    assert {k: len(v["value"]) > 0 for k, v in s["memory_bytes"].items()} == {"api_server": True, "engine_core": True}
    assert all(v is None or 0 <= v <= 1 for v in s["hit_rate"]["gpu"]["value"])
    text = page.read_text()
    assert text.count("<svg") == 7 and "<script" not in text.lower()
    assert not REMOTE.search(text), REMOTE.search(text)
    assert "url(http" not in text and "@import" not in text
    assert_pngs_and_csv(out, s)


PNGS = ("throughput", "latency", "hit_rate", "page_ins", "resident_adapters", "memory", "errors")


def assert_pngs_and_csv(out, series: dict) -> None:
    """Issue 43: the report also writes a PNG per chart (valid: PNG's signature, decodable, a
    real size) and series.csv, one row per point of every series in summary.json."""
    import csv

    from PIL import Image

    for stem in PNGS:
        path = out / f"{stem}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            img.load()  # every pixel decodes
            assert img.format == "PNG" and img.width > 300 and img.height > 80, (stem, img.size)
            assert len(set(img.convert("L").getdata())) > 2  # drawn on, not a blank canvas
    with open(out / "series.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["series", "label", "x", "y"]
    expected = {}
    for key, value in series.items():
        if key == "throughput":
            for label in ("ok_per_s", "errors_per_s", "output_tokens_per_s"):
                expected[key, label] = list(zip(value["t"], value[label]))
        elif key == "latency_cdf":
            expected.update({(key, label): list(zip(c["x"], c["p"])) for label, c in value.items()})
        elif key == "errors_by_status":
            expected.update({(key, label): [("", n)] for label, n in value.items()})
        else:
            expected.update({(key, label): list(zip(g["t"], g["value"])) for label, g in value.items()})
    got: dict = {}
    for r in rows:
        got.setdefault((r["series"], r["label"]), []).append(
            (float(r["x"]) if r["x"] else "", float(r["y"]) if r["y"] else None))
    assert got == {k: v for k, v in expected.items() if v}


def test_report_of_a_run_with_nothing_to_scrape(tmp_path):
    """A server without /metrics (a bare endpoint): every series is there, empty."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return PlainTextResponse("data: " + json.dumps({"choices": [{"text": "x"}]}) + "\n\ndata: [DONE]\n\n")

    with Served(app) as url:
        report = run_loadtest(LoadTestConfig(url=url, base_model="b", concurrency=2, duration=5, max_requests=6,
                                             progress=False, report_dir=str(tmp_path)))
    data = json.loads((tmp_path / "summary.json").read_text())
    assert report["ok"] == 6 and report["adapter_hit_rate"] is None
    assert set(data["series"]) == set(SERIES_KEYS)
    assert data["series"]["hit_rate"] == {} and data["series"]["memory_bytes"]["api_server"]["t"] == []
    assert "<svg" in (tmp_path / "report.html").read_text()
    assert_pngs_and_csv(tmp_path, data["series"])  # the no-data charts too


def test_cli_report_and_client_choice(fake_url, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    for client in ("raw", "httpx"):
        args = parser.parse_args(["loadtest", "--url", fake_url, "--requests", "4", "--concurrency", "2",
                                  "--max-tokens", str(TOKENS), "--no-progress", "--client", client,
                                  "--report", str(tmp_path / client)])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        assert f"client    {client}" in out and "report: " in out
        assert json.loads((tmp_path / client / "summary.json").read_text())["config"]["client"] == client


def test_wrk_falls_back_to_the_built_in_client(fake_url, monkeypatch, capsys):
    monkeypatch.setattr(wrk_mod, "find_wrk", lambda: None)
    report = run_loadtest(LoadTestConfig(url=fake_url, base_model="b", concurrency=2, duration=0.5,
                                         progress=False, client="wrk"))
    assert report["config"]["client"] == "raw" and report["ok"] > 0
    assert report["ttft_s"]["p50"] is not None
    assert "wrk is not installed" in capsys.readouterr().err


@pytest.mark.skipif(wrk_mod.find_wrk() is None, reason="wrk is not installed (optional)")
def test_wrk_run_counts_statuses(fake_url, tmp_path):
    report = run_loadtest(LoadTestConfig(url=fake_url, adapters=["acme/a", "missing/b"], dist="cycle",
                                         concurrency=2, duration=1, progress=False, client="wrk",
                                         report_dir=str(tmp_path)))
    assert report["config"]["client"] == "wrk" and report["ok"] > 0
    assert report["error_kinds"]["http 404"] > 0 and report["ttft_s"]["p50"] is None
    assert 0 < report["e2e_s"]["p50"] <= report["e2e_s"]["p99"]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert set(data["series"]) == set(SERIES_KEYS) and data["series"]["latency_cdf"]["e2e_s"]["x"]


@pytest.mark.parametrize("kw", [{"client": "curl"}, {"client": "wrk", "rate": 5.0, "concurrency": None},
                                {"client": "wrk", "max_requests": 3}, {"scrape_interval": 0}])
def test_bad_client_options_are_refused(kw):
    with pytest.raises(ValueError):
        LoadTestConfig(**{"url": "http://127.0.0.1:1", "concurrency": 2, **kw})


# -- the built-in client ------------------------------------------------------------------------------
def _run(coro):
    return asyncio.run(coro)


def test_client_keeps_connections_alive_and_reads_chunked_bodies(fake_url):
    async def go():
        async with HTTPClient(fake_url) as client:
            pieces: list[bytes] = []
            data = client.build("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "p"}).encode())
            statuses = [await client.request(data, pieces.append) for _ in range(5)]
            body = b"".join(pieces)
            missing = client.build("POST", "/v1/completions", b'{"model": "missing/x"}')
            status_404 = await client.request(missing)
            return statuses, body, status_404, len(client._open)

    statuses, body, status_404, opened = _run(go())
    assert statuses == [200] * 5 and status_404 == 404 and opened == 1
    assert body.count(b"data: [DONE]") == 5 and body.count(b'"text": " w0"') == 5


def test_client_reconnects_when_the_server_drops_an_idle_connection():
    app = FastAPI()

    @app.get("/x")
    async def x():
        return {"ok": True}

    async def go(url):
        async with HTTPClient(url, keepalive_expiry=60) as client:
            data = client.build("GET", "/x")
            first = await client.request(data)
            await asyncio.sleep(0.5)  # past the server's keep-alive: it closed the connection
            second = await client.request(data)
            return first, second

    with Served(app, timeout_keep_alive=0.2) as url:
        assert _run(go(url)) == (200, 200)


def test_client_times_out():
    with Served(fake_server_app()) as url:
        async def go():
            async with HTTPClient(url, timeout=0.1) as client:
                await client.request(client.build("POST", "/v1/completions", b'{"model": "slow/x"}'))

        with pytest.raises(ResponseTimeout):
            _run(go())


def test_client_reports_a_refused_connection():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connecting is refused

        async def go():
            async with HTTPClient(f"http://127.0.0.1:{port}", timeout=5) as client:
                await client.request(client.build("GET", "/"))

        with pytest.raises(OSError):
            _run(go())


# -- pieces -----------------------------------------------------------------------------------------
def test_cdf_is_bounded_and_monotone():
    assert cdf([]) == {"x": [], "p": []}
    c = cdf([3.0, 1.0, 2.0])
    assert c == {"x": [1.0, 2.0, 3.0], "p": pytest.approx([1 / 3, 2 / 3, 1.0])}
    big = cdf(list(range(10_000)), points=50)
    assert len(big["x"]) == 50 and big["x"] == sorted(big["x"]) and big["p"][-1] == 1.0


def test_timeline_keeps_only_the_series_it_draws():
    text = ('# TYPE loraserve_adapter_resident gauge\nloraserve_adapter_resident{tier="gpu"} 3\n'
            "# TYPE loraserve_batch_size gauge\nloraserve_batch_size 2\n"
            "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 5e6\n")
    assert parse_kept(text) == {'loraserve_adapter_resident{tier="gpu"}': 3.0,
                                "process_resident_memory_bytes": 5e6}


def test_server_metrics_carry_process_memory_and_the_core_rss():
    from prometheus_client import generate_latest

    from loraserve.server.metrics import ServerMetrics
    from loraserve.server.process_metrics import CoreMemoryCollector, rss_bytes

    class Core:
        core_pid = os.getpid()

    metrics = ServerMetrics()
    metrics.register(CoreMemoryCollector(Core()))
    values = parse_kept(generate_latest(metrics.registry).decode())
    assert values["process_resident_memory_bytes"] > 1e6
    assert values["loraserve_engine_core_rss_bytes"] > 1e6
    assert rss_bytes(os.getpid()) > 1e6 and rss_bytes(2 ** 22 + 12345) is None

    class NoCore:
        core_pid = None

    quiet = ServerMetrics()
    quiet.register(CoreMemoryCollector(NoCore()))
    assert "loraserve_engine_core_rss_bytes" not in generate_latest(quiet.registry).decode()


def test_memory_is_charted_anonymous_and_file_backed_apart(tmp_path):
    """The server's `loraserve_process_rss_bytes{process,kind}` (its own and the core's) becomes
    one series per process and kind; a mapped file's pages count as file-backed, not anonymous."""
    import mmap

    from prometheus_client import generate_latest

    from loraserve.loadgen.report import _memory_chart, _svg, build_series
    from loraserve.server.metrics import ServerMetrics
    from loraserve.server.process_metrics import CoreMemoryCollector, rss_kinds

    path = tmp_path / "mapped"
    path.write_bytes(b"x" * (64 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        before = rss_kinds(os.getpid())
        sum(m[i] for i in range(0, len(m), 4096))  # every page read: resident, file-backed
        after = rss_kinds(os.getpid())
    assert after["file"] - before["file"] >= 48 << 20
    assert after["anonymous"] - before["anonymous"] < 16 << 20

    class Core:
        core_pid = os.getpid()

    metrics = ServerMetrics()
    metrics.register(CoreMemoryCollector(Core()))
    rows = [(float(i), parse_kept(generate_latest(metrics.registry).decode())) for i in range(3)]
    report = {"error_kinds": {}, "wall_s": 3.0}
    series = build_series(report, None, rows, bin_s=1.0)
    assert set(series["memory_bytes"]) == {f"{p} {k}" for p in ("api_server", "engine_core")
                                           for k in ("anonymous", "file-backed")}
    assert all(len(g["value"]) == 3 and min(g["value"]) > 0 for g in series["memory_bytes"].values())
    svg = _svg(_memory_chart(series["memory_bytes"]))
    assert "engine_core file-backed" in svg and "api_server anonymous" in svg


def test_non_streamed_requests(tmp_path):
    """--no-stream: plain JSON answers; tokens from their usage, TTFT is the end-to-end time."""
    app = FastAPI()
    seen: list[dict] = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(await request.json())
        return {"choices": [{"index": 0, "text": "ab"}], "usage": {"completion_tokens": 2}}

    with Served(app) as url:
        report = run_loadtest(LoadTestConfig(url=url, base_model="b", concurrency=2, duration=5, max_requests=6,
                                             max_tokens=2, progress=False, stream=False))
    assert report["ok"] == 6 and report["output_tokens"] == 12
    assert report["ttft_s"] == report["e2e_s"]
    assert all(b["stream"] is False and "stream_options" not in b for b in seen)
    with pytest.raises(ValueError, match="no-stream"):
        LoadTestConfig(url=url, concurrency=1, stream=False, client="httpx")
