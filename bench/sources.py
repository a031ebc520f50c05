"""Cold adapters from object storage next to the local catalog and the device pool, side by side.

    python bench/sources.py [--adapters 16] [--rounds 2] [--rank 8]

One `loraserve serve` on the demo base (engine core in its own process, 127.0.0.1, a free port)
with `--adapter-source s3://bench/{tenant}/{name}` and `--catalog-store s3://bench-store/prod`,
against moto's S3 server started here (in this process, on 127.0.0.1: no network, so the store's
part is its protocol and our fetch/verify/export/import work, not a WAN's latency). Each round
makes `--adapters` fresh adapters of each kind and requests each once, one request at a time
(non-streamed, 1 token, temperature 0), timing the whole request as the client sees it (for a
1-token request, its TTFT):

  resident   an adapter already in the device pool (its second request)
  catalog    in the server's local LMDB catalog, never requested: page-in from disk
  store      only in the durable tier (published by another host's catalog): fault in the record
             and the verified blob, write it locally, page in
  s3 source  only as a PEFT directory in the source bucket: fetch the two files (ETag-checked),
             export against the base, import as a revision, page in

Prints p50 / p90 latency and requests/s of a sequential sweep per kind, and each kind's p50 as a
multiple of the catalog hit's (rounds interleave the kinds, so noise hits each alike). The
machine is 2 cores shared with the server: read the ratios.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "server")]

from adapter_files import write_peft  # noqa: E402
from s3_testing import free_port, moto_s3  # noqa: E402

from loraserve.catalog.base import BaseInfo  # noqa: E402
from loraserve.catalog.importer import adapter_blob  # noqa: E402
from loraserve.catalog.store import Catalog  # noqa: E402
from loraserve.catalog.store_s3 import ObjectStore, StoreTier  # noqa: E402

KINDS = ("resident", "catalog", "store", "s3 source")


def start_server(base: Path, catalog: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(REPO / ".venv/bin/loraserve"), "serve", "--model", str(base), "--catalog", str(catalog),
           "--port", str(port), "--device", "cpu", "--adapter-source", "s3://bench/{tenant}/{name}",
           "--catalog-store", "s3://bench-store/prod", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready")


def timed(http: httpx.Client, model: str) -> float:
    started = time.perf_counter()
    r = http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0})
    elapsed = time.perf_counter() - started
    if r.status_code != 200:
        raise SystemExit(f"{model}: {r.status_code} {r.text[:300]}")
    return elapsed


def prepare(rnd: int, n: int, base: Path, work: Path, rank: int, s3, local: Catalog, other: StoreTier) -> dict:
    """This round's adapter ids per kind, each put where its kind says."""
    info = BaseInfo.from_dir(base)
    ids: dict[str, list[str]] = {k: [] for k in KINDS}
    for i in range(n):
        peft = write_peft(work / f"p{rnd}-{i}", base, r=rank, seed=rnd * 1000 + i)
        blob = adapter_blob(peft, info)
        for kind, tenant in (("resident", "res"), ("catalog", "cat"), ("store", "sto"), ("s3 source", "src")):
            ids[kind].append(f"{tenant}/a{rnd}-{i}")
        local.put_revision(f"res/a{rnd}-{i}", blob)
        local.put_revision(f"cat/a{rnd}-{i}", blob)
        other.catalog.put_revision(f"sto/a{rnd}-{i}", blob)
        s3.put_dir("bench", f"src/a{rnd}-{i}", peft)
    return ids


def row(kind: str, times: list[float], catalog_p50: float) -> str:
    q = statistics.quantiles(times, n=10)
    p50 = statistics.median(times)
    return (f"| {kind} | {len(times)} | {p50 * 1e3:.1f} | {q[8] * 1e3:.1f} | {len(times) / sum(times):.1f} "
            f"| {p50 / catalog_p50:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
    base = REPO / ".loraserve/demo/qwen3"
    if not base.is_dir():
        subprocess.run([str(REPO / ".venv/bin/loraserve"), "demo"], check=True, cwd=REPO)
    work = Path(tempfile.mkdtemp(prefix="bench-sources-"))
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        with moto_s3() as s3:
            s3.client().create_bucket(Bucket="bench")
            s3.client().create_bucket(Bucket="bench-store")
            Catalog.create(work / "server", shards=8).close()
            other = StoreTier(ObjectStore("s3://bench-store/prod"), Catalog.create(work / "other", shards=8))
            proc, url = start_server(base, work / "server")
            try:
                with httpx.Client(base_url=url, timeout=300) as http:
                    for rnd in range(args.rounds):
                        with Catalog.open(work / "server") as local:
                            ids = prepare(rnd, args.adapters, base, work, args.rank, s3, local, other)
                        for i in range(args.adapters):  # interleaved: noise hits every kind alike
                            timed(http, ids["resident"][i])
                            times["resident"].append(timed(http, ids["resident"][i]))
                            for kind in KINDS[1:]:
                                times[kind].append(timed(http, ids[kind][i]))
            finally:
                proc.terminate()
                proc.wait(30)
                other.close()
                other.catalog.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    catalog_p50 = statistics.median(times["catalog"])
    print(f"demo base, rank {args.rank} q_proj/v_proj adapters, {args.rounds} rounds x {args.adapters}, "
          f"1-token requests one at a time, moto S3 on 127.0.0.1, {os.cpu_count()} CPUs")
    print("| adapter | requests | p50 ms | p90 ms | sequential req/s | p50 / catalog hit |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        print(row(kind, times[kind], catalog_p50))


if __name__ == "__main__":
    main()
