"""`loraserve keys create` and `loraserve serve --keys`: a created key is printed once, stored as
its hash only, and opens a server; a bad keys file stops `serve` with a one-line reason before
the model loads."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loraserve.cli import main
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
    assert key.startswith("tml-") and "\n" not in key
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


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`loraserve ARGS` in this process (a subprocess pays seconds of imports on a busy host)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _keys_file(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A keys file with a hand-written comment and tenant table, and three created keys."""
    path = tmp_path / "keys.toml"
    path.write_text("# the team's keys\n[tenants.acme]\nmax_concurrent = 4  # all of acme\n")
    path.chmod(0o600)
    made = {}
    for key_id, extra in (("ops", ["--admin"]), ("acme-a", ["--tenant", "acme", "--load"]),
                          ("acme-b", ["--tenant", "acme", "--max-concurrent", "2"])):
        out = _cli("keys", "create", "--keys", str(path), "--id", key_id, *extra)
        assert out.returncode == 0, out.stderr
        made[key_id] = out.stdout.strip()
    return path, made


def test_keys_list_shows_every_key_without_its_secret(tmp_path: Path) -> None:
    path, made = _keys_file(tmp_path)
    out = _cli("keys", "list", "--keys", str(path), "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["id"], r["role"], r["tenants"], r["load"]) for r in rows] == [
        ("ops", "admin", ["*"], False), ("acme-a", "user", ["acme"], True),
        ("acme-b", "user", ["acme"], False)]
    assert rows[2]["max_concurrent"] == 2 and "max_concurrent" not in rows[1]
    assert rows[1]["sha256"] == hashlib.sha256(made["acme-a"].encode()).hexdigest()[:8]
    text = _cli("keys", "list", "--keys", str(path)).stdout
    assert "acme-b\tuser\ttenants=acme\tload=false\tweight=1" in text
    assert not any(key in out.stdout + text for key in made.values())


def test_revoke_and_rotate_edit_one_entry_and_a_reload_applies_them(tmp_path: Path) -> None:
    path, made = _keys_file(tmp_path)
    engine = FakeEngine(adapters=("acme/support",))
    body = {"model": "acme/support", "prompt": "hi", "max_tokens": 2}
    with LiveServer(build_app(engine, keys=path)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        def status(key: str) -> int:
            return http.post("/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}).status_code

        assert status(made["acme-a"]) == status(made["acme-b"]) == 200
        out = _cli("keys", "revoke", "acme-a", "--keys", str(path))
        assert out.returncode == 0 and "revoked key 'acme-a'" in out.stderr
        rotated = _cli("keys", "rotate", "acme-b", "--keys", str(path))
        assert rotated.returncode == 0, rotated.stderr
        new_b = rotated.stdout.strip()
        assert new_b.startswith("tml-") and new_b != made["acme-b"]
        assert status(made["acme-a"]) == 200  # the server has not reloaded yet
        reload = http.post("/admin/reload-keys", headers={"X-API-Key": made["ops"]})
        assert reload.status_code == 200, reload.text
        assert status(made["acme-a"]) == 401 and status(made["acme-b"]) == 401
        assert status(new_b) == 200
    store = load_keys(path)
    assert [e.principal.key_id for e in store.entries] == ["ops", "acme-b"]
    assert store.find(new_b).limits == Limits(max_concurrent=2)  # the same principal
    text = path.read_text()
    assert text.startswith("# the team's keys\n") and "max_concurrent = 4  # all of acme" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    missing = _cli("keys", "revoke", "nobody", "--keys", str(path))
    assert missing.returncode == 1 and "no key with id 'nobody'" in missing.stderr


def test_an_edit_that_would_touch_other_entries_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    inline = (f'keys.a = {{ sha256 = "{GOOD_HASH}", role = "admin" }}\n'
              f'[keys.b]\nsha256 = "{hashlib.sha256(b"b").hexdigest()}"\nrole = "admin"\n')
    path.write_text(inline)
    out = _cli("keys", "revoke", "a", "--keys", str(path))
    assert out.returncode == 1 and "no [keys.a] table to edit" in out.stderr
    assert path.read_text() == inline


def test_a_stream_in_flight_ends_cleanly_when_its_key_is_revoked(tmp_path: Path) -> None:
    """The reload swaps the keys for new requests; a request keeps the principal it started
    with, so its stream runs to the end ([DONE]) while the same key's next request gets 401."""
    path, made = _keys_file(tmp_path)
    engine = FakeEngine(adapters=("acme/support",), delay_s=0.1)
    body = {"model": "acme/support", "prompt": "hi", "max_tokens": 40, "stream": True}
    auth = {"Authorization": f"Bearer {made['acme-a']}"}
    with LiveServer(build_app(engine, keys=path)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=auth) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert engine.running == 1 and '"text"' in first
            assert _cli("keys", "revoke", "acme-a", "--keys", str(path)).returncode == 0
            reload = http.post("/admin/reload-keys", headers={"X-API-Key": made["ops"]})
            assert reload.status_code == 200
            refused = http.post("/v1/completions", headers=auth,
                                json={**body, "stream": False, "max_tokens": 1})
            assert refused.status_code == 401
            assert engine.running == 1  # the stream was still running at the reload
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) == 40
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not engine.aborted


def test_created_and_rotated_keys_work_with_the_real_tinker_sdk(tmp_path: Path) -> None:
    """Issue 43: `keys rotate` of a tml- key printed an ls- key the Tinker SDK refuses. Every
    key `keys create` and `keys rotate` print now starts with tml-: the real SDK client takes
    the rotated key as printed, trades it for a token and is answered; the key it replaced is
    refused; a prefix the SDK would refuse is refused before any key is made."""
    import tinker

    path = tmp_path / "keys.toml"
    made = _cli("keys", "create", "--keys", str(path), "--id", "lab", "--tenant", "acme")
    assert made.returncode == 0, made.stderr
    old = made.stdout.strip()
    rotated = _cli("keys", "rotate", "lab", "--keys", str(path))
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert old.startswith("tml-") and new.startswith("tml-") and new != old
    admin = _cli("keys", "create", "--keys", str(path), "--admin", "--prefix", "tml-ops-")
    assert admin.stdout.startswith("tml-ops-")
    for bad in ("sk-", "ls-"):
        refused = _cli("keys", "rotate", "lab", "--keys", str(path), "--prefix", bad)
        assert refused.returncode == 1 and "tml-" in refused.stderr and refused.stdout == ""
    assert load_keys(path).find(new) is not None  # the refused rotations changed nothing
    engine = FakeEngine(adapters=("acme/support",))
    with LiveServer(build_app(engine, keys=path)) as live:
        client = tinker.ServiceClient(base_url=live.url, api_key=new)
        caps = client.get_server_capabilities()
        assert "fake-base" in [m.model_name for m in caps.supported_models]
        with pytest.raises(tinker.AuthenticationError):  # the key it replaced: 401 to the SDK
            tinker.ServiceClient(base_url=live.url, api_key=old).get_server_capabilities()
