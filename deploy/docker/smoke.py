"""Run the built image and ask it for completions: `make image`'s check, after build-image.sh.

    python3 deploy/docker/smoke.py [TAG]        default TAG: localhost/loraserve:cpu-demo

Two runs with podman (host network, the runtime and ulimits build-image.sh explains):
  1. as `docker run IMAGE` would: no settings; the image serves its SmolLM2 demo; the image's
     own HEALTHCHECK command passes (`podman healthcheck run`), /v1/models lists the demo
     base, the adapters demo/pirate and demo/french answer completions, SIGTERM (podman stop) drains it.
  2. as the Helm chart runs it: read-only root file system, tmpfs where the chart mounts its
     emptyDirs (/tmp, /var/lib/loraserve/cache, /var/lib/loraserve/demo; the demo is rebuilt
     and the GGUF converted again there), /dev/shm, uid 10001, every capability dropped, no
     new privileges, and an API key required ($LORASERVE_API_KEY, as keys.apiKey sets it):
     401 without the key, a completion with it.
Exit status 0 when every check passed; the container's log is printed when one failed.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

TAG = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("IMAGE_TAG", "localhost/loraserve:cpu-demo")
RUNTIME = os.environ.get("CONTAINER_RUNTIME", "runc")
NOFILE = subprocess.run(["sh", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
PODMAN = ["podman", "run", "-d", "--runtime", RUNTIME, "--network", "host",
          "--ulimit", f"nofile={NOFILE}:{NOFILE}", "--ulimit", "nproc=4096:4096"]
# the chart's emptyDirs (deploy/render.py: CACHE_DIR, DEMO_DIR, /tmp)
WRITABLE = ["/tmp", "/var/lib/loraserve/cache", "/var/lib/loraserve/demo"]


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
        with urllib.request.urlopen(req, timeout=120) as r:
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
    return http(port, "POST", "/v1/completions", {
        "model": model, "prompt": "What is the capital of France?", "max_tokens": 12,
        "temperature": 0}, key)


def run(name: str, extra: list[str], port: int, checks) -> None:
    subprocess.run(["podman", "rm", "-f", name], capture_output=True)
    cmd = [*PODMAN, "--name", name, "-e", f"LORASERVE_PORT={port}", *extra, TAG]
    print("+", " ".join(cmd), flush=True)
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
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
        print(f"{name}: {model}: {body['choices'][0]['text']!r}", flush=True)


def as_the_chart_runs_it(key: str):
    def checks(name: str, port: int) -> None:
        assert http(port, "GET", "/v1/models")[0] == 401
        assert complete(port, "demo/pirate")[0] == 401
        status, body = complete(port, "demo/pirate", key)
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
        print(f"{name}: demo/pirate with the key: {body['choices'][0]['text']!r}", flush=True)
        probe = subprocess.run(["podman", "exec", name, "sh", "-c", "touch /opt/x 2>&1; id -u"],
                               capture_output=True, text=True)
        assert "Read-only file system" in probe.stdout and probe.stdout.strip().endswith("10001"), probe
    return checks


def main() -> int:
    run("loraserve-smoke", [], free_port(), as_docker_runs_it)
    key = "sk-" + secrets.token_urlsafe(24)
    hardened = ["--read-only", "--user", "10001:10001", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--shm-size", "1g", "-e", f"LORASERVE_API_KEY={key}"]
    for path in WRITABLE:
        hardened += ["--tmpfs", f"{path}:rw,size=2g,mode=1777"]
    run("loraserve-smoke-hardened", hardened, free_port(), as_the_chart_runs_it(key))
    print(f"smoke: {TAG} served completions, as run by hand and as the chart runs it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
