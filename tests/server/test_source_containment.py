"""A source that misbehaves holds only its own bulkhead (issue 43): each failure of an `hf://`
upstream (hang, drip, a lying size, reset, garbage, a short body, a 500, unreachable) is a 503
with Retry-After naming the source, never a 500, and the next source is tried; another
tenant's local-dir adapter is served meanwhile; a local link into another tenant's subtree is
refused; no error body carries a server path or a source's URL. The seeded source fuzzer runs
here bounded; bench/sources_fuzz.py is its long run."""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loraserve.catalog.errors import SourceUnavailable
from loraserve.catalog.fetchers import HubFetcher
from loraserve.catalog.sources import AdapterSources
from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .adapter_files import write_peft
from .live import LiveServer
from source_fuzzing import BEHAVIOURS, BadHub, seeded

DEADLINE_S = 3.0
SERVED_WITHIN_S = 30.0  # generous: a fresh adapter's import and page-in on a busy machine
KEYS = {"acme": "k-acme", "beta": "k-beta"}
FUZZ_SEED = 43
CAP_MB = 4  # max_adapter_mb


def _keys_toml() -> str:
    return "".join(f'[keys.{t}]\nsha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n'
                   f'role = "user"\ntenants = ["{t}"]\n\n' for t, k in KEYS.items())


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


class Picker:
    """acme/<behaviour> behaves so; acme/fuzz-* from the seeded fuzzer; the rest is good."""

    def __init__(self) -> None:
        self.fuzz = seeded(FUZZ_SEED)

    def __call__(self, repo: str, method: str) -> str:
        name = repo.split("/", 1)[1]
        if name in BEHAVIOURS or name == "corrupt":
            return name
        if name.startswith("fuzz-") or name == "both":
            return self.fuzz(repo, method) if name != "both" else "hang"
        return "good"


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_dense) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("source-containment")
    cat_dir, hub_root, local = tmp / "catalog", tmp / "hub", tmp / "local"
    Catalog.create(cat_dir, shards=2).close()
    write_peft(tmp / "peft", hf_dense, seed=5)
    for name in (*BEHAVIOURS, "both", "corrupt", "huge", *(f"fuzz-{i}" for i in range(12))):
        shutil.copytree(tmp / "peft", hub_root / "acme" / name)
    (hub_root / "acme" / "huge" / "adapter_model.safetensors").write_bytes(b"\0" * (5 << 20))
    for name in ("both", *(f"l{i}" for i in range(40))):
        shutil.copytree(tmp / "peft", local / ("acme" if name == "both" else "beta") / name)
    shutil.copytree(tmp / "peft", local / "beta" / "secret")
    (local / "acme" / "x").symlink_to(Path("..") / "beta" / "secret")  # the attack
    (tmp / "keys.toml").write_text(_keys_toml())
    hub = BadHub(hub_root, Picker(), drip_s=1.0, lie_bytes=256 << 20)
    old = os.environ.get("HF_ENDPOINT")
    os.environ["HF_ENDPOINT"] = hub.endpoint
    try:
        engine = AsyncEngine.from_model_dir(
            str(hf_dense), catalog_dir=str(cat_dir), device="cpu", dtype="float32",
            max_model_len=64, max_batch_size=4, max_gpu_adapters=2, max_lora_rank=16,
            max_adapter_mb=CAP_MB, adapter_sources=["hf://{tenant}/{name}", f"{local}/{{tenant}}/{{name}}"],
            source_deadline_s=DEADLINE_S)
        with LiveServer(build_app(engine, max_n=2, keys=tmp / "keys.toml")) as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            hub_bulkhead = engine.sourcing.sources.bulkheads[0]
            hub_bulkhead.cooldown_s = 0.0  # every request meets the upstream's behaviour
            yield {"http": http, "hub": hub, "engine": engine, "tmp": tmp, "bulkhead": hub_bulkhead}
    finally:
        hub.close()
        if old is None:
            os.environ.pop("HF_ENDPOINT", None)
        else:
            os.environ["HF_ENDPOINT"] = old


def complete(http: httpx.Client, model: str, tenant: str) -> httpx.Response:
    return http.post("/v1/completions", headers=_auth(tenant),
                     json={"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0})


def assert_clean(r: httpx.Response, served: dict) -> None:
    """An OpenAI error body with no server path and no source URL in it."""
    error = r.json()["error"]
    text = r.text
    for leak in (str(served["tmp"]), "/tmp", "loraserve-fetch-", served["hub"].endpoint,
                 "127.0.0.1", "hf://"):
        assert leak not in text, (leak, text)
    assert set(error) == {"message", "type", "param", "code"}


def _wait_free(bulkhead, timeout_s: float = 60.0) -> None:
    """Let transfers left running past their deadline end (they hold the source's threads)."""
    deadline = time.monotonic() + timeout_s
    while bulkhead._slots._value < bulkhead.workers and time.monotonic() < deadline:
        time.sleep(0.1)


def _scratch_sizes(monkeypatch) -> list[int]:
    """The bytes each Hub fetch left in its scratch directory, as its `open` ended (raised
    included), before the directory was removed."""
    sizes: list[int] = []
    real = HubFetcher.open

    def measured(self, location: str, workdir: Path, max_bytes: int):
        try:
            return real(self, location, workdir, max_bytes)
        finally:
            sizes.append(sum(f.stat().st_size for f in workdir.rglob("*") if f.is_file()))
    monkeypatch.setattr(HubFetcher, "open", measured)
    return sizes


@pytest.mark.parametrize("behaviour", [b for b in BEHAVIOURS if b != "good"])
def test_each_failure_of_a_source_is_a_503_naming_it(served: dict, behaviour: str,
                                                     monkeypatch) -> None:
    _wait_free(served["bulkhead"])
    scratch = _scratch_sizes(monkeypatch)
    r = complete(served["http"], f"acme/{behaviour}", "acme")
    assert r.status_code == 503, r.text
    assert r.headers.get("Retry-After"), r.headers
    error = r.json()["error"]
    assert error["code"] == "source_unavailable" and "adapter source 1 (hf)" in error["message"]
    assert_clean(r, served)
    assert all(size <= CAP_MB << 20 for size in scratch), scratch  # nothing on disk past the cap
    if behaviour == "lie":  # the transfer stopped at the stated size, not at the lie's end:
        # what it took is the stated size and a read or two of 64 KiB blocks, plus what its
        # receive buffer and the Hub's send buffer (LIE_SNDBUF) held when it hung up: ~200 KiB
        assert served["hub"].max_sent < 1 << 20, served["hub"].max_sent  # a quarter of the cap
        assert scratch == [0], scratch  # and it wrote nothing


@pytest.mark.parametrize("name, status, words", [
    ("corrupt", 400, "checksum mismatch"),  # an answer, not a failure: no fall-through
    ("huge", 413, "bytes"),
])
def test_the_answers_of_a_source_name_no_url_or_path(served: dict, name: str, status: int,
                                                       words: str) -> None:
    _wait_free(served["bulkhead"])
    r = complete(served["http"], f"acme/{name}", "acme")
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert_clean(r, served)
    assert "adapter source 1 (hf)" in r.json()["error"]["message"]


def test_a_load_of_a_uri_outside_the_sources_names_none(served: dict) -> None:
    r = served["http"].post("/v1/load_lora_adapter", headers=_auth("acme"), json={
        "lora_name": "acme/elsewhere", "lora_path": "hf://beta/secret"})
    assert r.status_code in (401, 403), r.text
    assert_clean(r, served)


def test_a_failing_source_falls_through_to_the_next(served: dict) -> None:
    _wait_free(served["bulkhead"])
    r = complete(served["http"], "acme/both", "acme")  # the Hub hangs; the local dir has it
    assert r.status_code == 200, r.text
    source = served["engine"].catalog.catalog.resolve("acme/both").source
    assert source.startswith("file://") or "local" in source


def test_a_link_into_another_tenants_subtree_is_refused(served: dict) -> None:
    r = complete(served["http"], "acme/x", "acme")  # local/acme/x -> ../beta/secret
    assert r.status_code in (403, 404), r.text
    assert_clean(r, served)
    assert "beta" not in r.json()["error"]["message"]


def test_the_fuzzer_leaves_another_tenant_served(served: dict) -> None:
    """acme's misses meet the seeded fuzzer's upstream; beta's local-dir misses, at the same
    time, are each served within the bound."""
    _wait_free(served["bulkhead"])
    http, stop, beta_times, beta_fail = served["http"], threading.Event(), [], []

    def beta() -> None:
        i = 0
        while not stop.is_set() and i < 40:
            t0 = time.perf_counter()
            r = complete(http, f"beta/l{i}", "beta")
            beta_times.append(time.perf_counter() - t0)
            if r.status_code != 200:
                beta_fail.append(r.text)
            i += 1

    watcher = threading.Thread(target=beta)
    watcher.start()
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: complete(http, f"acme/fuzz-{i}", "acme"), range(12)))
    stop.set()
    watcher.join()
    assert all(r.status_code in (200, 503) for r in answers), [r.text for r in answers]
    for r in answers:
        if r.status_code == 503:
            assert r.headers.get("Retry-After") and "adapter source 1 (hf)" in r.text
            assert_clean(r, served)
    assert beta_times and not beta_fail, beta_fail[:3]
    assert max(beta_times) < SERVED_WITHIN_S, beta_times


def test_an_unreachable_hub_is_unavailable_not_an_error(tmp_path: Path, monkeypatch) -> None:
    with socket_closed() as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        sources = AdapterSources(["hf://{tenant}/{name}"], max_bytes=1 << 20, fetchers={
            "hf://{tenant}/{name}": HubFetcher(timeout_s=2.0)})
        with pytest.raises(SourceUnavailable) as err:
            sources.fetch("acme/x", lambda peft, uri: None)
    assert err.value.status == 503 and endpoint not in str(err.value)
    sources.close()


class socket_closed:
    """An endpoint where nothing listens."""

    def __enter__(self) -> str:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        pass


def test_an_unreachable_catalog_store_names_no_endpoint_or_bucket(monkeypatch) -> None:
    from loraserve.catalog.store_objects import ObjectStore
    with socket_closed() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        store = ObjectStore("s3://internal-bucket/prod")
        with pytest.raises(SourceUnavailable) as err:
            store.policy("acme/x")
    text = str(err.value)
    assert err.value.status == 503 and "internal-bucket" not in text and endpoint not in text, text
