"""`loraserve keys create` and `loraserve serve --keys`: a created key is printed once, stored as
its hash only, and opens a server; a bad keys file stops `serve` with a one-line reason before
the model loads."""
from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loraserve.server import build_app
from loraserve.keys import Limits, load_keys

from server.fake_engine import FakeEngine
from server.live import LiveServer


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraserve.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_keys_create_prints_a_key_that_then_authenticates(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    out = _run("keys", "create", "--keys", str(path), "--tenant", "acme", "--tenant", "beta",
               "--load", "--weight", "2", "--max-concurrent", "4", "--requests-per-second", "5",
               "--tokens-per-minute", "1000", "--id", "acme-ci")
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    assert key.startswith("ls-") and "\n" not in key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert key not in text and hashlib.sha256(key.encode()).hexdigest() in text
    admin = _run("keys", "create", "--keys", str(path), "--admin").stdout.strip()
    store = load_keys(path)
    p = store.find(key)
    assert p is not None and (p.key_id, p.admin, p.tenants, p.load, p.weight) == \
        ("acme-ci", False, ("acme", "beta"), True, 2.0)
    assert p.limits == Limits(4, 5.0, 1000)
    assert store.find(admin).admin
    again = _run("keys", "create", "--keys", str(path), "--tenant", "x", "--id", "acme-ci")
    assert again.returncode == 1 and again.stderr.strip().count("\n") == 0
    assert "exists" in again.stderr and again.stdout == ""
    assert _run("keys", "create", "--keys", str(path)).returncode == 1  # a user key needs a tenant
    engine = FakeEngine(adapters=("acme/support", "other/x"))
    with LiveServer(build_app(engine, keys=path)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        body = {"model": "acme/support", "prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        assert engine.requests[-1].tenant_weight == 2.0
        r = http.get("/v1/models", headers={"X-API-Key": key})
        assert [m["id"] for m in r.json()["data"]] == ["fake-base", "acme/support"]


GOOD_HASH = hashlib.sha256(b"k").hexdigest()


@pytest.mark.parametrize("text, reason", [
    (f'[keys.a]\nsha256 = "{GOOD_HASH[:-2]}"\nrole = "user"\ntenants = ["a"]\n', "64 hex digits"),
    (f'[keys.a]\nsha256 = "{GOOD_HASH}"\nrole = "owner"\ntenants = ["a"]\n', "unknown role"),
    (f'[keys.a]\nsha256 = "{GOOD_HASH}"\nrole = "user"\ntenants = ["a"\n', "malformed TOML"),
    (f'[keys.a]\nsha256 = "{GOOD_HASH}"\nrole = "user"\ntenants = ["a"]\nquota = 3\n',
     "unknown field 'quota'"),
])
def test_serve_refuses_a_bad_keys_file_before_loading_the_model(tmp_path: Path, text: str,
                                                                reason: str) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(text)
    out = _run("serve", "--keys", str(keys), "--model", str(tmp_path / "no-model"), "--port", "0")
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("loraserve serve: error: keys file") and reason in lines[0]


def test_serve_with_a_good_keys_file_goes_on_to_the_model(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[keys.a]\nsha256 = "{GOOD_HASH}"\nrole = "admin"\n')
    out = _run("serve", "--keys", str(keys), "--model", str(tmp_path / "no-model"), "--port", "0")
    assert out.returncode == 1 and "no-model" in out.stderr.splitlines()[-1]
