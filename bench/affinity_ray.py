"""Adapter affinity on the real scaled-out server: `loraserve serve --replicas N` on a local Ray,
Serve's default multiplexed routing (`--replica-routing multiplex`) and loraserve's
(`affinity`: rendezvous hashing with bounded loads, held adapters first), one after the other
in one run.

    python bench/affinity_ray.py                       # demo base on CPU, 2 replicas
    python bench/affinity_ray.py --adapters 12 --max-gpu-adapters 4 --zipf-requests 120
    python bench/affinity_ray.py --adapters 100 --max-gpu-adapters 4 --gaps 0 --rounds 1 \
        --zipf-requests 400
    python bench/affinity_ray.py --catalog-adapters 100000 --replicas 3 --adapters 3 \
        --rounds 0 --max-gpu-adapters 8 --zipf-requests 600    # issue 26's 100,000 adapters

Per routing, on a fresh server (the demo base and catalog; `--adapters` adapters: the demo's
three and more loaded at run time under new ids, the same weights):
  1. issue 26's sequence: one request at a time, every adapter in turn, with gaps of 0, 0.5
     and 2 s between requests (`--rounds` rounds per gap); reported: the adapters that more
     than one replica served (each such adapter takes a device slot on every replica it
     touched), and the sequences of replicas;
  2. a Zipf workload (exponent 1.1 over the adapters, or with `--catalog-adapters N` over N
     synthetic rank-1 adapters materialized into the catalog first by `loraserve catalog
     materialize`; `--concurrency` clients, `--zipf-requests` requests; `--replicas` replicas
     sharing 2 CPUs): requests/s, and the cluster's device-pool hit rate from the replicas' own
     counters (loraserve_adapter_hits_total / lookups, tier gpu, over all replicas), measured
     as the difference across the workload.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraserve.demo import DEMO_ADAPTERS, build_demo

HEADER = "x-loraserve-replica"
CATALOG_PREFIX = "zipf/a"
PROMPT = DEMO_ADAPTERS[0][1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(demo, work: Path, routing: str, args) -> tuple[subprocess.Popen, str]:
    catalog = work / f"catalog-{routing}"
    shutil.copytree(demo.catalog, catalog)
    port = free_port()
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--replicas", str(args.replicas),
           "--ray-num-cpus", "2", "--replica-cpus", str(2 / args.replicas),
           "--ray-object-store-mb", "128", "--port", str(port), "--model", str(demo.qwen3),
           "--catalog", str(catalog), "--adapter-root", str(demo.root / "adapters"),
           "--device", "cpu", "--max-model-len", "512", "--max-batch-size", "4",
           "--max-gpu-adapters", str(args.max_gpu_adapters), "--torch-threads", "1",
           "--replica-routing", routing]
    log = open(work / f"server-{routing}.log", "wb")
    ray_tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_TMPDIR": ray_tmp})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {routing} server exited; see {work}/server-{routing}.log")
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the {routing} server was not ready in 400 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def load_adapters(http: httpx.Client, count: int) -> list[str]:
    """The demo's adapters, and more under new ids (the demo's weights) up to `count`."""
    names = [a for a, _, _ in DEMO_ADAPTERS][:count]
    for i in range(count - len(names)):
        name = f"bench/a{i}"
        r = http.post("/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": DEMO_ADAPTERS[i % 3][0]})
        r.raise_for_status()
        names.append(name)
    return names


def one(http: httpx.Client, model: str, max_tokens: int = 4) -> str:
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.headers[HEADER]


def sequence(http: httpx.Client, adapters: list[str], rounds: int,
             gaps: list[float]) -> dict[float, dict[str, list[str]]]:
    """gap -> adapter -> the replicas that served its requests, in order."""
    out = {}
    for gap in gaps:
        served: dict[str, list[str]] = {a: [] for a in adapters}
        for _ in range(rounds):
            for adapter in adapters:
                served[adapter].append(one(http, adapter))
                time.sleep(gap)
        out[gap] = served
    return out


def pool_counters(http: httpx.Client) -> tuple[float, float]:
    """(hits, misses) of the device pools of every replica."""
    hits = misses = 0.0
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if s.labels.get("tier") != "gpu":
                continue
            if s.name == "loraserve_adapter_hits_total":
                hits += s.value
            elif s.name == "loraserve_adapter_misses_total":
                misses += s.value
    return hits, misses


def zipf(http: httpx.Client, adapters: list[str], requests: int, concurrency: int,
         seed: int) -> tuple[float, float]:
    """(requests/s, device-pool hit rate) of a Zipf(1.1) workload over `adapters`."""
    rng = random.Random(seed)
    weights = [(k + 1) ** -1.1 for k in range(len(adapters))]
    picks = rng.choices(adapters, weights, k=requests)
    h0, m0 = pool_counters(http)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda a: one(http, a, 8), picks))
    took = time.perf_counter() - t0
    time.sleep(1.5)  # the replicas' next reports carry the last counters
    h1, m1 = pool_counters(http)
    lookups = (h1 - h0) + (m1 - m0)
    return requests / took, (h1 - h0) / lookups if lookups else float("nan")


def materialize(demo, count: int) -> list[str]:
    """`count` synthetic rank-1 adapters in the demo's catalog (`loraserve catalog
    materialize`, the bulk CLI), before the servers copy it; their ids, in Zipf rank order."""
    subprocess.run([sys.executable, "-m", "loraserve.cli", "catalog", "materialize",
                    str(demo.catalog), "--model", str(demo.qwen3), "--count", str(count),
                    "--rank", "1", "--prefix", CATALOG_PREFIX, "--no-progress"], check=True)
    width = max(7, len(str(count - 1)))
    return [f"{CATALOG_PREFIX}{i:0{width}d}" for i in range(count)]


def run_one(demo, work: Path, routing: str, args, catalog_ids: list[str]) -> dict:
    proc, url = start(demo, work, routing, args)
    try:
        with httpx.Client(base_url=url, timeout=120,
                          limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
            adapters = load_adapters(http, args.adapters)
            seq = sequence(http, adapters, args.rounds, args.gaps) if args.rounds else {}
            rps, hit = zipf(http, catalog_ids or adapters, args.zipf_requests, args.concurrency,
                            args.seed)
    finally:
        stop(proc)
    return {"routing": routing, "sequence": seq, "rps": rps, "hit": hit}


def report(results: list[dict]) -> None:
    print(f"{'routing':>10} {'gap s':>6} {'adapters on >1 replica':>23}  replicas per adapter, in order")
    for res in results:
        names: dict[str, str] = {}
        for gap, served in res["sequence"].items():
            split = sum(len(set(s)) > 1 for s in served.values())
            seqs = " ".join("".join(names.setdefault(r, "ABCD"[len(names)] if len(names) < 4 else "?")
                                    for r in s) for s in served.values())
            seqs = seqs if len(served) <= 16 else "(" + str(len(served)) + " adapters)"
            print(f"{res['routing']:>10} {gap:>6.1f} {split:>14}/{len(served):<8}  {seqs}")
    print()
    print(f"{'routing':>10} {'requests/s':>11} {'device-pool hit rate':>21}")
    for res in results:
        print(f"{res['routing']:>10} {res['rps']:>11.2f} {res['hit']:>21.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the adapters per gap")
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.5, 2.0],
                   help="seconds between the sequence's requests, one pass each")
    p.add_argument("--max-gpu-adapters", type=int, default=2, help="device slots per replica")
    p.add_argument("--zipf-requests", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--routings", nargs="+", default=["multiplex", "affinity"],
                   choices=["multiplex", "affinity"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (2 CPUs shared)")
    p.add_argument("--catalog-adapters", type=int, default=0,
                   help="materialize this many synthetic adapters and draw the Zipf workload "
                        "over them (0: over the --adapters of the sequence)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="affinity-ray-"))
    demo = build_demo(work / "demo")
    catalog_ids = materialize(demo, args.catalog_adapters) if args.catalog_adapters else []
    results = [run_one(demo, work, routing, args, catalog_ids) for routing in args.routings]
    report(results)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
