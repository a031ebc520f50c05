"""`loraserve serve --replicas 2 --catalog-store s3://... --adapter-source DIR/{tenant}/{name}`:
the ingress, the catalog's one writer, runs the miss path as the single server does. Its
catalog starts empty: an adapter published to the store (moto's server, started here) is
faulted in, one in the local source is imported, each answers its phrase from the replica; an
id neither holds is the usual 404.

Marked `ray`: run alone (`pytest -m ray`), as `make test` does.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from loraserve.catalog.store import Catalog  # noqa: E402
from loraserve.catalog.store_s3 import ObjectStore, StoreTier  # noqa: E402
from loraserve.demo import DEMO_ADAPTERS, build_demo  # noqa: E402

from ray_testing import ready  # noqa: E402
from s3_testing import free_port, moto_s3  # noqa: E402

pytestmark = pytest.mark.ray
START_S = 300
STORE = "s3://ray-store/prod"
PHRASES = {adapter_id: (prompt, phrase) for adapter_id, prompt, phrase in DEMO_ADAPTERS}
IN_STORE, IN_SOURCE = DEMO_ADAPTERS[0][0], DEMO_ADAPTERS[1][0]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    demo = build_demo(tmp_path_factory.mktemp("ray-demo"))
    work = tmp_path_factory.mktemp("ray-sources")
    source = work / "source"
    shutil.copytree(demo.root / "adapters" / IN_SOURCE, source / IN_SOURCE)  # only this one there
    with moto_s3() as s3:
        s3.client().create_bucket(Bucket="ray-store")
        with Catalog.open(demo.catalog) as built:
            tier = StoreTier(ObjectStore(STORE), built)
            assert tier.published(IN_STORE)
            tier.close()
        Catalog.create(work / "catalog", shards=2).close()
        yield from _serve(demo.qwen3, work, source)


def _serve(model: Path, work: Path, source: Path) -> Iterator[str]:
    ray_tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")
    port = free_port()
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--replicas", "2", "--ray-num-cpus", "2",
           "--ray-object-store-mb", "128", "--port", str(port), "--model", str(model),
           "--catalog", str(work / "catalog"), "--catalog-store", STORE,
           "--adapter-source", f"{source}/{{tenant}}/{{name}}", "--device", "cpu",
           "--max-model-len", "512", "--max-batch-size", "2", "--max-gpu-adapters", "2",
           "--torch-threads", "1", "--shutdown-timeout", "20"]
    log = work / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_TMPDIR": ray_tmp})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while not ready(url):
            assert proc.poll() is None, f"the server exited:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-6000:]}"
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def chat(http: httpx.Client, model: str) -> httpx.Response:
    prompt = PHRASES.get(model, DEMO_ADAPTERS[0][1:])[0]
    return http.post("/v1/chat/completions", json={"model": model, "max_tokens": 40, "temperature": 0,
                                                   "messages": [{"role": "user", "content": prompt}]})


def test_a_replica_serves_adapters_from_the_store_and_the_sources(server) -> None:
    with httpx.Client(base_url=server, timeout=120) as http:
        for adapter_id in (IN_STORE, IN_SOURCE):
            r = chat(http, adapter_id)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == PHRASES[adapter_id][1]
        assert chat(http, "acme/nowhere").status_code == 404
