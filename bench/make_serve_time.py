"""`make serve` to its first answer, as a new user meets it: a first start (empty demo directory
and GGUF cache: the file is converted and the demo catalog built) and a second (both kept).

    python bench/make_serve_time.py [--port 18123]

Each start runs `make serve` with DEMO_DIR and LORASERVE_CACHE in one fresh temporary directory,
polls `/ready`, then asks `demo/pirate` a greedy chat question until it answers; prints the
seconds from the command to each, and the answer. The venv must exist (`make venv`).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTION = {"model": "demo/pirate", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "Maria moved to Lisbon last year."}]}


def start(label: str, port: int, demo_dir: Path, cache: Path, limit_s: float = 900) -> None:
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(["make", "-s", "serve", f"PORT={port}", f"DEMO_DIR={demo_dir}"], cwd=ROOT,
                            env=dict(os.environ, LORASERVE_CACHE=str(cache)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    ready = None
    try:
        while time.perf_counter() - t0 < limit_s:
            try:
                if ready is None and httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    ready = time.perf_counter() - t0
                if ready is not None:
                    r = httpx.post(f"{url}/v1/chat/completions", json=QUESTION, timeout=120)
                    if r.status_code == 200:
                        answer = r.json()["choices"][0]["message"]["content"]
                        print(f"{label}: /ready {ready:.1f} s, first answer {time.perf_counter() - t0:.1f} s: "
                              f"{answer!r}", flush=True)
                        return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"make serve exited with {proc.returncode}")
            time.sleep(0.2)
        raise SystemExit(f"{label}: no answer within {limit_s:.0f} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=18123)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="make-serve-") as tmp:
        demo, cache = Path(tmp) / "demo", Path(tmp) / "cache"
        start("first start (empty demo directory and GGUF cache)", args.port, demo, cache)
        start("second start (both kept)", args.port, demo, cache)


if __name__ == "__main__":
    main()
