"""Error bodies name no server path (issue 43: they echoed temp paths): every way a runtime
import from `--adapter-root` can fail (missing, not a directory, no config, a config or weights
that do not parse, a rank the server cannot hold, a link or a path out of the root) answers an
OpenAI error naming `lora_path` as the client gave it, and nothing of the server's directories:
not the adapter root, the catalog, the base, nor a scratch directory. The source and object-store
errors are held by test_source_containment.py and test_s3_store.py."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app

from .adapter_files import write_peft
from .live import LiveServer


def _plant(root: Path, base: Path) -> None:
    """The bad adapter directories under the adapter root `root`."""
    (root / "noconfig").mkdir(parents=True)
    (root / "noconfig" / "adapter_model.safetensors").write_bytes(b"x")
    (write_peft(root / "badconfig", base) / "adapter_config.json").write_text("{nope")
    (write_peft(root / "badweights", base) / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    write_peft(root / "bigrank", base, r=64)
    write_peft(root / "good", base)
    (root / "link").symlink_to(base)
    (root / "file").write_text("x")


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dense: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("server-private")
    Catalog.create(tmp / "catalog", shards=2).close()
    _plant(tmp / "adapters", demo_dense)
    engine = AsyncEngine.from_model_dir(
        str(demo_dense), catalog_dir=str(tmp / "catalog"), device="cpu", dtype="float32",
        max_model_len=64, max_batch_size=4, max_lora_rank=8, adapter_root=str(tmp / "adapters"))
    with LiveServer(build_app(engine)) as live, \
            httpx.Client(base_url=live.url, timeout=120) as http:
        yield {"http": http, "private": (str(tmp), str(demo_dense))}


# (lora_path as the client sends it, status, error code)
BAD_PATHS = [
    ("missing", 404, "source_not_found"),
    ("file", 400, "export_error"),
    ("noconfig", 400, "export_error"),
    ("badconfig", 400, "export_error"),
    ("badweights", 400, "export_error"),
    ("bigrank", 400, "invalid_request"),
    ("link", 403, "source_forbidden"),
    ("../catalog", 403, "source_forbidden"),
    ("good/../../catalog", 403, "source_forbidden"),
    ("/etc", 403, "source_forbidden"),
]


def assert_names_no_server_path(r: httpx.Response, sent: str, private: tuple[str, ...]) -> None:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    text = r.text.replace(sent, "<sent>")  # the client's own words may come back
    for leak in (*private, "/tmp", "/pytest-of-", "loraserve-fetch-"):
        assert leak not in text, (leak, text)


@pytest.mark.parametrize(("lora_path", "status", "code"), BAD_PATHS)
def test_a_failed_runtime_import_names_no_server_path(served: dict, lora_path: str, status: int,
                                                       code: str) -> None:
    r = served["http"].post("/v1/load_lora_adapter",
                            json={"lora_name": f"bad-{code}", "lora_path": lora_path})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == "lora_path", error
    assert_names_no_server_path(r, lora_path, served["private"])


def test_a_server_path_sent_as_lora_path_is_refused_as_sent(served: dict) -> None:
    """An absolute path into the server's own directories: refused, echoing only what was sent."""
    private = served["private"][0]
    r = served["http"].post("/v1/load_lora_adapter",
                            json={"lora_name": "bad-abs", "lora_path": f"{private}/catalog"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "source_forbidden", r.text
    assert_names_no_server_path(r, f"{private}/catalog", served["private"])


def test_the_good_one_loads(served: dict) -> None:  # the failures above are the paths', not the setup's
    r = served["http"].post("/v1/load_lora_adapter", json={"lora_name": "ok", "lora_path": "good"})
    assert r.status_code == 200 and r.json()["id"] == "default/ok", r.text
    assert served["http"].post("/v1/unload_lora_adapter", json={"lora_name": "ok"}).status_code == 200
