"""A materialized catalog into the durable tier, and a cold sweep back out through an empty host.

    python bench/store_publish.py [--adapters 2000] [--rank 8] [--workers 1,4,8,16] [--sweep 500]
                                  [--no-rerun] [--paths segments,per-adapter]

`catalog materialize` builds `--adapters` rank-`--rank` q_proj/v_proj revisions on the demo
base; each `--workers` value then publishes the whole catalog (`catalog.store_bulk.publish_catalog`:
new adapters in segments, one policy PUT each) into its own prefix of moto's S3 server (in
another process, on 127.0.0.1: `moto_server`), timed, and published again (the resume path:
every adapter already there; `--no-rerun` skips it). `--paths per-adapter` publishes the way it
was done before segments (five requests an adapter), for a side-by-side ratio. Last, a host
whose LMDB starts empty faults `--sweep` adapters in one after another (policy read, ranged segment read verified by checksum,
local write). The moto server's resident memory is printed at the end (it keeps every object
in memory: what bounds a run's size here).

moto is a Python server on the same 2 cores as the publishing threads: the figures are this
machine's ceiling for the protocol and our per-adapter work, not an object store's.

    python bench/store_publish.py --materialize [--servers moto,s3rver] [--steps 50000,100000]
                                  [--minutes 40] [--rank 1] [--sweep 1000]

times `catalog materialize --store` instead: each worker publishes every batch as it commits it
(catalog.store_materialize). Each step is a rerun of the same materialize over a larger count
(the resume path), until `--minutes` have passed; then the cold sweep. `--store-only` builds
into the store alone (`catalog materialize --store-only`: the local catalog keeps nothing). `--servers` picks the S3
server, one after the other: moto_server, or s3rver (npm's Node server, keeping objects as files
rather than in memory; installed into .loraserve/s3rver on first use; it ignores If-None-Match,
so the policies' conditional creates are plain PUTs there, the same request count).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

from s3_testing import ENV, free_port  # noqa: E402

from loraserve.catalog.materialize import MaterializeConfig, materialize  # noqa: E402
from loraserve.catalog.materialize_worker import adapter_id  # noqa: E402
from loraserve.catalog.store import Catalog  # noqa: E402
from loraserve.catalog.store_bulk import PublishReport, publish_catalog  # noqa: E402
from loraserve.catalog.store_s3 import ObjectStore, StoreTier  # noqa: E402


S3RVER = REPO / ".loraserve/s3rver"  # npm's s3rver (a Node S3 server keeping objects as files), installed here
S3RVER_VERSION = "3.7.1"


def start_server(kind: str, work: Path) -> tuple[subprocess.Popen, str]:
    """moto_server (Python, every object in its memory) or s3rver (Node, objects as files under
    `work`) on a free port of 127.0.0.1, the AWS environment pointed at it, with a bucket `bench`."""
    import os
    import boto3
    import httpx
    port = free_port()
    if kind == "moto":
        cmd, env = [str(REPO / ".venv/bin/moto_server"), "-H", "127.0.0.1", "-p", str(port)], ENV
    else:
        cmd = [str(s3rver_bin()), "-d", str(work / "s3rver"), "-a", "127.0.0.1", "-p", str(port), "--silent"]
        env = {**ENV, "AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"}  # its fixed key
        (work / "s3rver").mkdir(parents=True, exist_ok=True)
    # s3rver's continuation tokens use a cipher Node 17+ keeps behind the legacy provider
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "NODE_OPTIONS": "--openssl-legacy-provider"})
    url = f"http://127.0.0.1:{port}"
    os.environ.update(env, AWS_ENDPOINT_URL=url)
    try:
        for _ in range(100):
            try:
                httpx.get(url, timeout=1)
                boto3.session.Session().client("s3").create_bucket(Bucket="bench")  # this environment's keys
                return proc, url
            except httpx.HTTPError:
                time.sleep(0.2)
        raise SystemExit(f"{kind} did not start")
    except BaseException:
        stop_server(proc)
        raise


def s3rver_bin() -> Path:
    """s3rver's entry point, installed from the npm registry into .loraserve/s3rver when missing."""
    binary = S3RVER / "node_modules/.bin/s3rver"
    if not binary.exists():
        S3RVER.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(S3RVER),
                        f"s3rver@{S3RVER_VERSION}"], check=True, stdout=subprocess.DEVNULL)
    return binary


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)  # a moto holding 100,000 objects takes a while to go
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def disk_mib(path: Path) -> int:
    return int(subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True).stdout.split()[0])


def bucket_bytes(root: Path, adapters: int) -> str:
    """The bytes of the objects s3rver holds under `root` (its object files, not its metadata
    files or the file system's blocks), per adapter: what a real bucket would bill."""
    total = objects = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith("._S3rver_object"):
                total, objects = total + os.stat(os.path.join(folder, name)).st_size, objects + 1
    return f"{objects} objects, {total / 2**20:.0f} MiB of object bytes, {total / max(adapters, 1):.0f} B an adapter"


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def per_adapter(built: Catalog, tier: StoreTier, workers: int, progress: bool = False) -> PublishReport:
    """The publish before segments, kept to compare: every adapter through `StoreTier.published`
    (policy read, blob HEAD and PUT, record PUT, policy PUT), a page on `workers` threads."""
    report = PublishReport()
    with ThreadPoolExecutor(workers) as pool:
        while page := [p.adapter_id for p in built.list(limit=1000, after=report.last)]:
            report.published += sum(pool.map(tier.published, page))
            report.adapters += len(page)
            report.last = page[-1]
    return report


def built_count(built: Catalog) -> int:
    return built.stats()["adapters"]


def publish_rates(built: Catalog, workers_list: list[int], rerun: bool, path: str) -> None:
    print("| path | workers | publish adapters/s | re-run (resume) adapters/s |")
    print("|---|---|---|---|")
    publish = publish_catalog if path == "segments" else per_adapter
    for workers in workers_list:
        # moto lists by sorting every key of the bucket: its listings slow down with the bucket
        store = ObjectStore(f"s3://bench/{path}-w{workers}", timeout_s=120.0, max_pool=max(10, workers))
        tier = StoreTier(store, built)
        rates = []
        for _ in range(2 if rerun else 1):
            started = time.perf_counter()
            rep = publish(built, tier, workers=workers, progress=built_count(built) >= 10000)
            rates.append(rep.adapters / (time.perf_counter() - started))
            print(f"  ({rep.adapters} adapters, {rep.published} published, "
                  f"{time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
        tier.close()
        print(f"| {path} | {workers} | {rates[0]:.0f} | {rates[1] if rerun else float('nan'):.0f} |", flush=True)


def cold_sweep(work: Path, prefix: str, built: MaterializeConfig, sweep: int) -> None:
    with Catalog.create(work / "empty", shards=8) as empty:
        tier = StoreTier(ObjectStore(prefix), empty)
        ids = [adapter_id(built.prefix, i, built.width) for i in range(0, built.count, max(1, built.count // sweep))]
        started = time.perf_counter()
        for one in ids:
            tier.fault_in(one)
        took = time.perf_counter() - started
        tier.close()
    print(f"cold sweep through an empty host: {len(ids)} fault-ins, {len(ids) / took:.0f}/s, "
          f"{took / len(ids) * 1e3:.1f} ms each")


def materialize_into(kind: str, work: Path, base: Path, args) -> None:
    """`catalog materialize --store` into `kind`'s server, a step of `--steps` at a time (each a
    rerun over a larger count: the resume path), until `--minutes`; then the cold sweep."""
    proc, _ = start_server(kind, work)
    try:
        Catalog.create(work / "built", shards=8).close()
        print("| server | adapters | step s | step adapters/s | all adapters/s | load average |\n"
              "|---|---|---|---|---|---|", flush=True)
        began, cfg = time.perf_counter(), None
        for count in [int(c) for c in args.steps.split(",")]:
            started = time.perf_counter()
            cfg = MaterializeConfig(work / "built", base, count, rank=args.rank, workers=2, progress=False,
                                    store="s3://bench/materialized", store_only=args.store_only)
            rep = materialize(cfg)
            if not rep.ok or rep.published != rep.written:
                raise SystemExit(f"materialize --store: {rep}")
            took, total = time.perf_counter() - started, time.perf_counter() - began
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"| {kind} | {count} | {took:.0f} | {rep.written / took:.0f} | {count / total:.0f} | {load} |",
                  flush=True)
            if total > args.minutes * 60:
                break
        cold_sweep(work, "s3://bench/materialized", cfg, args.sweep)
        if args.gc:
            gc_pass(ObjectStore("s3://bench/materialized", timeout_s=120.0, max_pool=16))
        where = f"resident memory {rss_mib(proc.pid)} MiB" if kind == "moto" else \
            f"objects on disk {disk_mib(work / 's3rver')} MiB ({bucket_bytes(work / 's3rver', cfg.count)})"
        print(f"{kind}: {where}; the local catalog {disk_mib(work / 'built')} MiB", flush=True)
    finally:
        stop_server(proc)


def gc_pass(store: ObjectStore) -> None:
    """`catalog store-gc --dry-run`'s pass over the store, timed twice: the first mark reads
    every policy (no mark cache yet), the second only those changed since (none: store_mark)."""
    from loraserve.catalog.store_gc import collect
    for which in ("first (every policy read)", "second (the mark's cache)"):
        started = time.perf_counter()
        rep = collect(store, min_age_s=0.0, workers=8, dry_run=True)
        took = time.perf_counter() - started
        print(f"store-gc --dry-run, {which}: {rep.policies} policies, {rep.live_revisions} live revisions in "
              f"{took:.1f} s ({rep.policies / took:.0f} policies/s); would delete {sum(rep.deleted.values())}",
              flush=True)


def publish_into(kind: str, work: Path, base: Path, args) -> None:
    """`catalog publish` of a materialized catalog (module doc), then the cold sweep."""
    proc, _ = start_server(kind, work)
    try:
        Catalog.create(work / "built", shards=8).close()
        started = time.perf_counter()
        cfg = MaterializeConfig(work / "built", base, args.adapters, rank=args.rank, workers=2, progress=False)
        materialize(cfg)
        print(f"materialize {args.adapters}: {time.perf_counter() - started:.1f} s", flush=True)
        workers = [int(w) for w in args.workers.split(",")]
        with Catalog.open(work / "built") as built:
            for path in args.paths.split(","):
                publish_rates(built, workers, args.rerun, path)
        cold_sweep(work, f"s3://bench/{args.paths.split(',')[0]}-w{workers[-1]}", cfg, args.sweep)
        if kind == "moto":
            print(f"moto_server resident memory: {rss_mib(proc.pid)} MiB")
    finally:
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--workers", default="1,4,8,16")
    ap.add_argument("--sweep", type=int, default=500)
    ap.add_argument("--no-rerun", dest="rerun", action="store_false")
    ap.add_argument("--paths", default="segments,per-adapter",
                    help="segments (catalog publish) and/or per-adapter (the publish before segments)")
    ap.add_argument("--servers", default="moto", help="moto and/or s3rver, run one after the other")
    ap.add_argument("--materialize", action="store_true",
                    help="time `catalog materialize --store` (build and publish as it goes) instead")
    ap.add_argument("--steps", default="2000", help="--materialize: the counts, each a rerun over more")
    ap.add_argument("--minutes", type=float, default=40.0, help="--materialize: no further step after this")
    ap.add_argument("--gc", action="store_true", help="--materialize: then time a store-gc --dry-run pass")
    ap.add_argument("--store-only", action="store_true",
                    help="--materialize: `--store-only` (nothing kept in the local catalog)")
    args = ap.parse_args()
    base = REPO / ".loraserve/demo/qwen3"
    for kind in args.servers.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"bench-publish-{kind}-"))
        try:
            (materialize_into if args.materialize else publish_into)(kind, work, base, args)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
