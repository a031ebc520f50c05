"""A materialized catalog into the durable tier, and a cold sweep back out through an empty host.

    python bench/store_publish.py [--adapters 2000] [--workers 1,4,8] [--sweep 500]

`catalog materialize` builds `--adapters` rank-8 q_proj/v_proj revisions on the demo base; each
`--workers` value then publishes the whole catalog (`catalog.store_bulk.publish_catalog`) into
its own prefix of moto's S3 server (in another process, on 127.0.0.1: `moto_server`), timed, and
published again (the resume path: every adapter already there). Last, a host whose LMDB starts
empty faults `--sweep` adapters in one after another (record + verified blob + local write).

moto is a Python server on the same 2 cores as the publishing threads: the figures are this
machine's ceiling for the protocol and our per-adapter work, not an object store's.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

from s3_testing import ENV, free_port  # noqa: E402

from loraserve.catalog.materialize import MaterializeConfig, materialize  # noqa: E402
from loraserve.catalog.store import Catalog  # noqa: E402
from loraserve.catalog.store_bulk import publish_catalog  # noqa: E402
from loraserve.catalog.store_s3 import ObjectStore, StoreTier  # noqa: E402


def start_moto() -> tuple[subprocess.Popen, str]:
    import os
    import httpx
    port = free_port()
    proc = subprocess.Popen([str(REPO / ".venv/bin/moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    os.environ.update(ENV, AWS_ENDPOINT_URL=url)
    for _ in range(100):
        try:
            httpx.get(url, timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("moto_server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--sweep", type=int, default=500)
    args = ap.parse_args()
    base = REPO / ".loraserve/demo/qwen3"
    work = Path(tempfile.mkdtemp(prefix="bench-publish-"))
    proc, _ = start_moto()
    try:
        import boto3
        boto3.client("s3").create_bucket(Bucket="bench")
        Catalog.create(work / "built", shards=8).close()
        started = time.perf_counter()
        materialize(MaterializeConfig(work / "built", base, args.adapters, rank=8, workers=2, progress=False))
        print(f"materialize {args.adapters}: {time.perf_counter() - started:.1f} s")
        print("| workers | publish adapters/s | re-run (resume) adapters/s |")
        print("|---|---|---|")
        with Catalog.open(work / "built") as built:
            for workers in [int(w) for w in args.workers.split(",")]:
                tier = StoreTier(ObjectStore(f"s3://bench/w{workers}"), built)
                rates = []
                for _ in range(2):
                    started = time.perf_counter()
                    rep = publish_catalog(built, tier, workers=workers, progress=False)
                    rates.append(rep.adapters / (time.perf_counter() - started))
                tier.close()
                print(f"| {workers} | {rates[0]:.0f} | {rates[1]:.0f} |")
        with Catalog.create(work / "empty", shards=8) as empty:
            tier = StoreTier(ObjectStore(f"s3://bench/w{workers}"), empty)
            ids = [f"synth/a{i:07d}" for i in range(0, args.adapters, max(1, args.adapters // args.sweep))]
            started = time.perf_counter()
            for adapter_id in ids:
                tier.fault_in(adapter_id)
            took = time.perf_counter() - started
            tier.close()
        print(f"cold sweep through an empty host: {len(ids)} fault-ins, {len(ids) / took:.0f}/s, "
              f"{took / len(ids) * 1e3:.1f} ms each")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
