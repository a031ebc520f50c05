"""Start-up with default flags: time to /ready and to the first token, first and second start
(issue 41), with the decode step compiling in the background.

    python bench/startup.py --model PATH [--starts 2] [--probe-every 20] [--timeout 1800]

Each start is `loraserve serve --model PATH` with no other flag, as a user starts it. The first
start gets an empty compile cache (a fresh LORASERVE_COMPILE_CACHE and TORCHINDUCTOR_CACHE_DIR);
the later ones reuse it. A GGUF file's conversion is cached where it always is (LORASERVE_CACHE),
so convert it once before. Per start: seconds to `/ready` answering 200, to the first streamed
token of a 64-token greedy completion, and until `/ready` lists nothing compiling; one stream's
decode tokens/s at the first answer (eager), while compiling (every `--probe-every` s: min and
median) and once done; the compiled buckets.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_stream(c: httpx.Client, model: str, tokens: int = 64) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) of one greedy streamed completion."""
    t0, first, n = time.perf_counter(), None, 0
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
                first = first or time.perf_counter()
    return first - t0, (n - 1) / (time.perf_counter() - first)


def start(model: str, env: dict, probe_every: float, timeout: float, log: Path) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(ROOT / ".venv/bin/loraserve"), "serve", "--model", model,
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    row: dict = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            while True:
                assert proc.poll() is None, f"the server exited; see {log}"
                try:
                    r = c.get("/ready")
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            row["ready_s"] = time.perf_counter() - t0
            name = c.get("/v1/models").json()["data"][0]["id"]
            asked = time.perf_counter() - t0
            ttft, row["eager_tok_s"] = one_stream(c, name)
            row["first_token_s"] = asked + ttft
            during = []
            while (body := c.get("/ready").json()).get("compiling"):
                assert time.perf_counter() - t0 < timeout, f"still compiling after {timeout} s"
                time.sleep(probe_every)
                if c.get("/ready").json().get("compiling"):
                    during.append(one_stream(c, name)[1])
            row["compiled_s"] = time.perf_counter() - t0
            row["during"] = during
            row["compiled"] = body.get("compiled", [])
            row["after_tok_s"] = one_stream(c, name)[1]
    finally:
        proc.terminate()
        proc.wait(30)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--probe-every", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="loraserve-startup-"))
    env = {**os.environ, "LORASERVE_COMPILE_CACHE": str(cache / "choices.json"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    print(f"model {args.model}; compile cache {cache} (empty at the first start)")
    print("| start | /ready s | first token s | compile done s | eager tok/s | during compile tok/s "
          "(min / median) | after tok/s | compiled buckets |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for i in range(args.starts):
        r = start(args.model, env, args.probe_every, args.timeout, cache / f"server-{i}.log")
        during = (f"{min(r['during']):.1f} / {statistics.median(r['during']):.1f}"
                  if r["during"] else "-")
        print(f"| {'first' if i == 0 else 'again'} | {r['ready_s']:.1f} | {r['first_token_s']:.1f} | "
              f"{r['compiled_s']:.0f} | {r['eager_tok_s']:.1f} | {during} | {r['after_tok_s']:.1f} | "
              f"{', '.join(r['compiled']) or 'none'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
