"""The source fuzzer's long run (issue 43): a server with `--adapter-source hf://{tenant}/{name}`
then a local directory, the Hub a fake upstream that hangs, drips, lies about sizes, resets,
serves garbage, short bodies and 500s (tests/source_fuzzing.py `BadHub`, seeded), while another
tenant's misses come from the local directory. Prints, per outcome of the attacking tenant's
requests, how many and their latency, and the other tenant's latency (max, p50, p99). Never
asserts: the bounded run with assertions is tests/server/test_source_containment.py.

    python bench/sources_fuzz.py [--minutes 5] [--seed 43] [--deadline 5] [--attackers 8]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter, defaultdict

import httpx

from loraserve.catalog.store import Catalog
from loraserve.demo import build_demo_base
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import build_app
from server.adapter_files import write_peft
from server.live import LiveServer
from source_fuzzing import BadHub, seeded

KEYS = {"acme": "k-acme", "beta": "k-beta"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--deadline", type=float, default=5.0, help="serve --source-deadline-s")
    ap.add_argument("--attackers", type=int, default=8, help="concurrent attacking clients")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sources-fuzz-"))
    try:
        run(tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(tmp: Path, args) -> None:
    base = build_demo_base(tmp / "base", arch="qwen3", seed=0)
    write_peft(tmp / "peft", base, seed=1)
    hub_root, local = tmp / "hub", tmp / "local"
    names = [f"f{i}" for i in range(2000)]
    for name in names:  # links: the Hub's repos, cheaply
        (hub_root / "acme" / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(tmp / "peft", hub_root / "acme" / name)
    for i in range(2000):  # copies: a link out of the tenant's subtree is refused (403)
        shutil.copytree(tmp / "peft", local / "beta" / f"l{i}")
    keys = tmp / "keys.toml"
    keys.write_text("".join(f'[keys.{t}]\nsha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n'
                            f'role = "user"\ntenants = ["{t}"]\n\n' for t, k in KEYS.items()))
    hub = BadHub(hub_root, seeded(args.seed), drip_s=1.0)
    os.environ["HF_ENDPOINT"] = hub.endpoint
    Catalog.create(tmp / "catalog", shards=4).close()
    engine = AsyncEngine.from_model_dir(
        str(base), catalog_dir=str(tmp / "catalog"), device="cpu", dtype="float32",
        max_model_len=64, max_batch_size=4, max_gpu_adapters=4, max_lora_rank=16,
        adapter_sources=["hf://{tenant}/{name}", f"{local}/{{tenant}}/{{name}}"],
        source_deadline_s=args.deadline)
    outcomes: Counter = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    stop = threading.Event()
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client(tenant: str, prefix: str) -> None:
        with httpx.Client(base_url=server.url, timeout=300,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as http:
            while not stop.is_set():
                with lock:
                    i = next(counter) % 2000
                t0 = time.perf_counter()
                try:
                    r = http.post("/v1/completions", json={"model": f"{tenant}/{prefix}{i}",
                                                           "prompt": "hi", "max_tokens": 2})
                    key = f"{tenant} {r.status_code} {r.json()['error']['code'] if r.status_code != 200 else ''}"
                except httpx.HTTPError as exc:
                    key = f"{tenant} {type(exc).__name__}"
                with lock:
                    outcomes[key.strip()] += 1
                    latency[tenant].append(time.perf_counter() - t0)

    with LiveServer(build_app(engine, max_n=2, keys=keys)) as server:
        threads = [threading.Thread(target=client, args=("acme", "f")) for _ in range(args.attackers)]
        threads.append(threading.Thread(target=client, args=("beta", "l")))
        for t in threads:
            t.start()
        time.sleep(args.minutes * 60)
        stop.set()
        for t in threads:
            t.join(timeout=args.deadline * 4 + 60)
    hub.close()
    print(f"{'outcome':40} {'requests':>9}")
    for key, n in sorted(outcomes.items()):
        print(f"{key:40} {n:9d}")
    print(f"\n{'tenant':8} {'n':>6} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for tenant, xs in sorted(latency.items()):
        xs = sorted(xs)
        print(f"{tenant:8} {len(xs):6d} {statistics.median(xs):8.3f} "
              f"{xs[min(len(xs) - 1, int(len(xs) * 0.99))]:8.3f} {xs[-1]:8.3f}")
    print(f"\nupstream behaviours served: {Counter(b for _, _, b in hub.seen).most_common()}")
    print(f"largest body a lie got to send: {hub.max_sent} bytes")


if __name__ == "__main__":
    main()
