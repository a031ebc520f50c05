"""Adapter residency under load, against a live `loraserve serve` subprocess, one run.

    python bench/lora_residency.py cliff --catalog DIR [--model DIR] [--slots 8] [--rate 20] [--duration 30]
    python bench/lora_residency.py sweep --catalog DIR [--model DIR] [--adapters 100000] [--concurrency 64]
                                         [--warm-seconds 30]
                                         [--source DIR] [--profile DIR [--profile-seconds 10]]
    python bench/lora_residency.py wrk --catalog DIR [--model DIR] [--duration 10] [--rounds 2]
                                       [--slices 5] [--page-cache warm|as-is] [--source DIR]...
                                       [--profile DIR]

cliff: TTFT when the working set fits the device pool (all resident after a warm-up) against a
       working set 10x the pool's slots (every request likely a miss), same open-loop rate.
sweep: one server (--max-gpu-adapters 64 --cpu-cache-mb 256) first serves 48 adapters for
       --warm-seconds (the warm rate, same server and load), then N distinct adapters drawn
       from the catalog, each once (the sweep, quoted as its ratio to the warm rate); /metrics and the server's RSS are sampled every second to
       show the resident sets never pass their bounds and memory stays flat.
wrk:   issue 29's workload, wrk at 64 connections, 2-token requests, `--max-gpu-adapters 64
       --cpu-cache-mb 256`: base only, warm (48 adapters that stay resident) and cold (every
       request a never-seen adapter, a fresh slice of the catalog per run), warm and cold
       alternating in --slices pieces of duration/slices each, per server tree (this
       one and each --source, one server each, runs interleaved); req/s, cold/warm, the CPU
       ms per request of each process (API, engine core, and their catalog shard hosts), and
       the prompt tokens each request computed (a warm adapter's requests find most of their
       prompt in its prefix cache; a never-seen adapter's find nothing: `--serve-args
       --no-prefix-caching` takes that difference out and leaves the price of paging in).
       The catalog is read into the OS page cache first (`--page-cache warm`, when it fits in
       half the memory available; its residency is printed): a blob read from the disk costs
       the shard hosts a major fault per page, and how much of a catalog this machine's page
       cache holds otherwise depends on what ran before (`--page-cache as-is` measures that).
The catalog must be built for the same base (e.g. `loraserve catalog materialize`).
Each measured run also writes `loraserve loadtest`'s report (report.html: throughput, latency and
TTFT CDFs, tier hit rates, page-ins, resident adapters and server memory over time; summary.json)
under --report DIR (default .loraserve/reports/residency-<mode>).

--source DIR serves from another source tree (e.g. `git archive` of the commit before a change,
as bench/hot_path.py's --baseline), so two runs of one session compare code on the same catalog.
--profile DIR samples the API process and the engine core with py-spy while the sweep runs (raw
stacks in DIR) and prints where their CPU goes, by bench/hot_path.py's categories.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import ctypes
import mmap
import os
import re
import shlex
import statistics
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from loraserve.catalog.store import Catalog
from loraserve.loadtest import LoadTestConfig, run_loadtest


def start_server(model: str, catalog: str, port: int, *extra: str, source: str | None = None
                 ) -> subprocess.Popen:
    """`loraserve serve` on port; from the source tree `source` when given (else this one)."""
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(Path(model).resolve()),
           "--catalog", str(Path(catalog).resolve()), "--port", str(port), "--log-level", "warning", *extra]
    env = None
    if source is not None:
        env = {**os.environ, "PYTHONPATH": str(Path(source).resolve())}
    proc = subprocess.Popen(cmd, env=env, cwd=source)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


def catalog_files(catalog: str) -> list[Path]:
    return sorted(Path(catalog).glob("shard-*/data.mdb"))


def page_cache_resident(catalog: str) -> tuple[int, int]:
    """(bytes of the catalog's shard files in the OS page cache, their total size): `mincore`
    over a read-only map of each file (mapping it reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in catalog_files(catalog):
        size = path.stat().st_size
        total += size
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vec = ctypes.create_string_buffer((size + page - 1) // page)
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                resident += sum(b & 1 for b in vec.raw) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return min(resident, total), total


def residency_line(catalog: str) -> str:
    resident, total = page_cache_resident(catalog)
    return f"catalog page cache: {resident / max(total, 1):.0%} of {total / 2**30:.1f} GiB resident"


def warm_page_cache(catalog: str) -> str:
    """Read the catalog's shard files through once, when they fit in half the memory available,
    so that a cold request's blob read is the same page-cache hit on every run: a catalog read
    from the disk the first time costs its shard hosts a major fault per page (bench/RESULTS.md),
    and how much of it the page cache holds depends on what this machine did before. What it
    found and did, as a line for the report."""
    before, total = page_cache_resident(catalog)
    available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    if total > available // 2:
        return (f"{residency_line(catalog)}, left as is (more than half of the "
                f"{available / 2**30:.1f} GiB available)")
    started = time.perf_counter()
    for path in catalog_files(catalog):
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    after, _ = page_cache_resident(catalog)
    return (f"catalog page cache: {before / total:.0%} of {total / 2**30:.1f} GiB resident before the run, "
            f"{after / total:.0%} after reading it through ({time.perf_counter() - started:.1f} s)")


def rss_mb(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB. File-backed pages are the catalog's LMDB maps in the
    OS page cache (reclaimable); the anonymous part is the server's own memory."""
    text = Path(f"/proc/{pid}/status").read_text()
    kb = lambda key: int(re.search(rf"{key}:\s+(\d+)", text).group(1))
    return kb("RssAnon") / 1024, kb("RssFile") / 1024


def scrape(url: str) -> dict[str, float]:
    out = {"requests": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r'(loraserve_adapter_resident(?:_bytes)?)\{tier="(\w+)"\} ([\d.e+]+)', line)
        if m:
            out[f"{m.group(1)}[{m.group(2)}]"] = float(m.group(3))
        elif line.startswith("loraserve_requests_total{"):  # answered requests, every status
            out["requests"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith(("loraserve_prefix_cache_queries_total ", "loraserve_prefix_cache_hits_total ")):
            out[line.split("_total ")[0].rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return out


def per_tenth(samples) -> list[tuple[float, float]]:
    """(requests/s, engine core anonymous RSS MiB at its end) for each tenth of the run, by
    the requests answered (a tenth = a tenth of the requests, so the last one is not a tail)."""
    done = [(t, scraped.get("requests", 0.0), core[0]) for t, _, scraped, core in samples]
    if not done:
        return []
    first, total, out, start = done[0][1], done[-1][1], [], (done[0][0], done[0][1])
    for q in range(1, 11):  # counted from the first sample (a warm phase before it is not a tenth)
        at = next((d for d in done if d[1] >= first + (total - first) * q / 10), done[-1])
        span = at[0] - start[0]
        out.append(((at[1] - start[1]) / span if span > 0 else 0.0, at[2]))
        start = (at[0], at[1])
    return out


def adapter_ids(catalog: str, n: int) -> list[str]:
    with Catalog.open(catalog, readonly=True) as cat:
        ids, after = [], None
        while len(ids) < n:
            page = cat.list(limit=min(10_000, n - len(ids)), after=after)
            if not page:
                break
            ids += [p.adapter_id for p in page]
            after = page[-1].adapter_id
    return ids


def cliff(args, model: str) -> None:
    url = f"http://127.0.0.1:{args.port}"
    ids = adapter_ids(args.catalog, 10 * args.slots)
    proc = start_server(model, args.catalog, args.port, "--max-gpu-adapters", str(args.slots))
    try:
        common = dict(url=url, rate=args.rate, duration=args.duration, prompt_len=8, max_tokens=8, progress=False)
        run_loadtest(LoadTestConfig(adapters=ids[: args.slots], **{**common, "duration": 5}))  # warm-up
        resident = run_loadtest(LoadTestConfig(adapters=ids[: args.slots], report_dir=f"{args.report}/resident",
                                               **common))
        missing = run_loadtest(LoadTestConfig(adapters=ids, report_dir=f"{args.report}/10x-slots", **common))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"cache-miss cliff: {args.slots} device slots, open loop {args.rate} req/s, {args.duration}s each")
    print(f"{'working set':>24} {'ok':>6} {'err':>5} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'gpu hit':>8}")
    for name, rep in ((f"{args.slots} (all resident)", resident), (f"{10 * args.slots} (10x slots)", missing)):
        t = rep["ttft_s"]
        hits = (rep.get("adapter_hit_rate") or {}).get("gpu")
        print(f"{name:>24} {rep['ok']:>6} {rep['errors']:>5} {1000 * t['p50']:>12.1f} {1000 * t['p99']:>12.1f} "
              f"{hits if hits is None else round(hits, 3)!s:>8}")
    print(f"TTFT p99 ratio (10x / resident): {missing['ttft_s']['p99'] / resident['ttft_s']['p99']:.2f}x")
    print(f"reports: {resident['report_html']}, {missing['report_html']}")


def start_profile(proc: subprocess.Popen, out: Path, seconds: float) -> dict[str, subprocess.Popen]:
    """py-spy on the API process and the engine core for `seconds` (raw stacks under out)."""
    from hot_path import server_pids  # bench/hot_path.py, beside this script
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    return {k: subprocess.Popen([pyspy, "record", "-p", str(p), "-d", str(int(seconds)), "-r", "250",
                                 "--nonblocking", "-f", "raw", "-o", str(out / f"{k}.txt")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for k, p in server_pids(proc.pid).items()}


def print_profile(out: Path) -> None:
    """Share of each process's samples by bench/hot_path.py's categories, and its top frames."""
    from hot_path import CATEGORIES, CORE_CATEGORIES, categorize, top_self  # beside this script
    for k in ("api", "core"):
        path = out / f"{k}.txt"
        if not path.exists():
            continue
        counts, total = categorize(path, CORE_CATEGORIES + CATEGORIES if k == "core" else CATEGORIES)
        idle = counts.pop(CATEGORIES[0][0], 0)
        busy = max(total - idle, 1)
        print(f"\nprofile {k}: {busy} busy samples (of {total})\n| where | share |\n|---|---:|")
        for name, n in counts.most_common(14):
            print(f"| {name} | {100 * n / busy:.1f}% |")
        print(f"top self frames ({k}):")
        for frame, n in top_self(path):
            print(f"  {n:6d}  {frame[:140]}")


def sweep(args, model: str) -> None:
    url = f"http://127.0.0.1:{args.port}"
    ids = adapter_ids(args.catalog, args.adapters)
    print(residency_line(args.catalog), flush=True)  # a namespace sweep reads what it finds
    serve_args = ["--max-gpu-adapters", "64", "--cpu-cache-mb", "256", *shlex.split(args.serve_args)]
    proc = start_server(model, args.catalog, args.port, *serve_args, source=args.source)
    samples, stop = [], threading.Event()
    profilers: dict[str, subprocess.Popen] = {}
    if args.profile:  # a moment in, so the samples are of the steady state
        timer = threading.Timer(2.0, lambda: profilers.update(
            start_profile(proc, Path(args.profile), args.profile_seconds)))
        timer.daemon = True
        timer.start()

    def monitor():
        core_pid = None
        while not stop.is_set():
            try:
                if core_pid is None:
                    from hot_path import server_pids  # bench/hot_path.py, beside this script
                    core_pid = server_pids(proc.pid).get("core")
                core = rss_mb(core_pid) if core_pid else (0.0, 0.0)
                samples.append((time.time(), rss_mb(proc.pid), scrape(url), core))
            except (httpx.HTTPError, OSError):
                pass
            stop.wait(1.0)

    warm = None
    if args.warm_seconds > 0:  # the warm rate this run's sweep is compared with: 48 resident adapters
        warm = run_loadtest(LoadTestConfig(url=url, adapters=ids[:WARM_ADAPTERS], dist="cycle",
                                           concurrency=args.concurrency, duration=args.warm_seconds,
                                           prompt_len=4, max_tokens=2, progress=False))
    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    try:
        rep = run_loadtest(LoadTestConfig(url=url, adapters=ids, dist="cycle", concurrency=args.concurrency,
                                          max_requests=len(ids), duration=args.duration_cap, prompt_len=4,
                                          max_tokens=2, progress=True, report_dir=args.report))
    finally:
        stop.set()
        thread.join(5)
        for p in profilers.values():
            p.wait(60)
        proc.terminate()
        proc.wait(30)
    gpu = max(s[2].get("loraserve_adapter_resident[gpu]", 0) for s in samples)
    cpu_bytes = max(s[2].get("loraserve_adapter_resident_bytes[cpu]", 0) for s in samples)
    anon, files = [s[1][0] for s in samples], [s[1][1] for s in samples]
    tenth = max(len(anon) // 10, 1)
    print(f"sweep: {len(ids)} distinct adapters, closed loop x{args.concurrency}, {shlex.join(serve_args)}")
    print(f"ok={rep['ok']} errors={rep['errors']} {rep['error_kinds'] or ''} duration={rep['wall_s']:.1f}s "
          f"req/s={rep['req_per_s']:.1f}")
    if warm is not None:
        print(f"warm first ({WARM_ADAPTERS} adapters, {args.warm_seconds:.0f} s, same server and load): "
              f"req/s={warm['req_per_s']:.1f}, errors={warm['errors']}; sweep / warm = "
              f"{rep['req_per_s'] / max(warm['req_per_s'], 1e-9):.2f}")
    bound = lambda flag: [v for f, v in zip(serve_args, serve_args[1:]) if f == flag][-1]  # the last one wins
    print(f"max resident gpu adapters={gpu:.0f} (bound {bound('--max-gpu-adapters')}); "
          f"max cpu cache bytes={cpu_bytes / 2**20:.1f} MiB (bound {bound('--cpu-cache-mb')})")
    for name, xs in (("anonymous", anon), ("file-backed (LMDB maps)", files)):
        print(f"server RSS {name} MiB: first 10% avg {sum(xs[:tenth]) / tenth:.0f}, "
              f"last 10% avg {sum(xs[-tenth:]) / tenth:.0f}, max {max(xs):.0f}")
    core_anon, core_files = [s[3][0] for s in samples], [s[3][1] for s in samples]
    at = lambda xs, q: xs[min(int(q * len(xs)), len(xs) - 1)]
    print("RSS MiB at 10% / 90% of the run (anonymous; file-backed = LMDB pages in the page cache): "
          f"API process {at(anon, 0.1):.0f} / {at(anon, 0.9):.0f} (files {at(files, 0.1):.0f} / {at(files, 0.9):.0f}), "
          f"engine core {at(core_anon, 0.1):.0f} / {at(core_anon, 0.9):.0f} "
          f"(files {at(core_files, 0.1):.0f} / {at(core_files, 0.9):.0f})")
    print("engine core anonymous RSS MiB at each tenth of the run: "
          + " ".join(f"{at(core_anon, q / 10):.0f}" for q in range(1, 10)))
    tenths = per_tenth(samples)
    print("| tenth of the requests | " + " | ".join(str(q) for q in range(1, 11)) + " |\n|---|"
          + "---:|" * 10)
    print("| requests/s | " + " | ".join(f"{r:,.0f}" for r, _ in tenths) + " |")
    print("| engine core anonymous RSS MiB at its end | " + " | ".join(f"{m:,.0f}" for _, m in tenths) + " |")
    if tenths and tenths[0][0]:
        print(f"last tenth / first tenth throughput: {tenths[-1][0] / tenths[0][0]:.2f}; core anonymous "
              f"RSS at 90% / 10% of the run: {at(core_anon, 0.9) / max(at(core_anon, 0.1), 1):.3f}")
    print(f"report: {rep['report_html']}")
    if profilers:
        print_profile(Path(args.profile))


# -- issue 29's workload: base / warm / cold under wrk -----------------------------------------------

WARM_ADAPTERS = 48  # a warm set that stays resident in a 64-slot pool


def process_groups(pid: int) -> dict[str, list[int]]:
    """The server's processes by role: api, core, and the catalog shard hosts of each."""
    from hot_path import server_pids  # bench/hot_path.py, beside this script
    groups: dict[str, list[int]] = {}
    for role, parent in server_pids(pid).items():
        groups[role] = [parent]
        kids = []
        for task in Path(f"/proc/{parent}/task").glob("*"):  # a host started by a pager thread
            try:                                              # is that thread's child
                kids += task.joinpath("children").read_text().split()
            except OSError:
                pass
        for kid in kids:
            try:
                if b"loraserve-shard-host" in Path(f"/proc/{kid}/cmdline").read_bytes():
                    groups.setdefault(f"{role} hosts", []).append(int(kid))
            except OSError:
                pass
    return groups


def group_cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each role's processes, and of the API's and the core's main
    threads apart ("api main", "core main": the event loop and the engine thread; the rest of
    those processes is pager, grammar and executor threads)."""
    from hot_path import cpu_seconds  # bench/hot_path.py, beside this script
    out = {}
    for role, pids in groups.items():
        total = 0.0
        for p in pids:
            try:
                total += cpu_seconds(p)
            except OSError:
                pass
        out[role] = total
        if not role.endswith("hosts"):
            try:
                out[f"{role} main"] = cpu_seconds(f"{pids[0]}/task/{pids[0]}")
            except OSError:
                out[f"{role} main"] = 0.0
    return out


def wrk_run(url: str, groups: dict[str, list[int]], adapters: list[str], seconds: float) -> dict:
    """One wrk run (c64, 2-token non-streamed completions); req/s, CPU ms/request per role, and
    prompt tokens per request looked up and computed (not found in the prefix cache)."""
    before = scrape(url)
    cpu0 = group_cpu(groups)
    rep = run_loadtest(LoadTestConfig(url=url, adapters=adapters, dist="cycle", concurrency=64,
                                      duration=seconds, client="wrk", stream=False, prompt_len=4,
                                      max_tokens=2, progress=False, timeout=60))
    cpu1 = group_cpu(groups)
    rep["cpu_ms"] = {r: 1e3 * (cpu1[r] - cpu0[r]) / max(rep["ok"], 1) for r in cpu0}
    after, n = scrape(url), max(rep["ok"], 1)
    looked_up = after.get("queries", 0.0) - before.get("queries", 0.0)
    rep["prompt"] = (looked_up / n, (looked_up - after.get("hits", 0.0) + before.get("hits", 0.0)) / n)
    return rep


def merged(parts: list[dict]) -> dict:
    """wrk_run's report of several runs taken as one: req/s over their summed wall time, CPU ms
    and prompt tokens per request weighted by each run's requests."""
    ok = sum(p["ok"] for p in parts)
    weight = [p["ok"] / max(ok, 1) for p in parts]
    wall = sum(p["wall_s"] for p in parts)
    return {"ok": ok, "errors": sum(p["errors"] for p in parts), "wall_s": wall,
            "req_per_s": ok / max(wall, 1e-9),
            "cpu_ms": {k: sum(w * p["cpu_ms"][k] for w, p in zip(weight, parts)) for k in parts[0]["cpu_ms"]},
            "prompt": tuple(sum(w * p["prompt"][j] for w, p in zip(weight, parts)) for j in (0, 1))}


def warm_cold(url: str, groups: dict, warm: list[str], fresh: list[str], seconds: float,
              slices: int) -> tuple[dict, dict]:
    """The warm and the cold run, each `seconds` long, taken as `slices` alternating pieces
    (warm, cold, warm, ...): this host's speed drifts within seconds, and a ratio of two runs
    10 s apart measured that drift as much as the paging (0.47-0.78 in one session)."""
    hot, chill, used = [], [], 0
    for _ in range(slices):
        hot.append(wrk_run(url, groups, warm, seconds / slices))
        part = wrk_run(url, groups, fresh[used:], seconds / slices)
        used += part["ok"] + part["errors"] + 64  # the next piece starts past every id sent
        chill.append(part)
    return merged(hot), merged(chill)


def wrk_mode(args, model: str) -> None:
    """Issue 29's table: base, warm and cold req/s per tree, interleaved rounds (see module doc)."""
    trees = [("this tree", None)] + [(src, src) for src in args.source_list]
    serve = ["--max-gpu-adapters", "64", "--cpu-cache-mb", "256", *shlex.split(args.serve_args)]
    per_cold = int(args.duration * 4000)  # more ids than a run can use
    ids = adapter_ids(args.catalog, WARM_ADAPTERS + per_cold * args.rounds * len(trees))
    if len(ids) < WARM_ADAPTERS + per_cold * args.rounds * len(trees):
        raise SystemExit(f"{args.catalog} has {len(ids):,} adapters; this run needs "
                         f"{WARM_ADAPTERS + per_cold * args.rounds * len(trees):,} (48 warm, then "
                         f"--duration x 4,000 never-seen ones per run): a bigger catalog, or fewer rounds")
    warm, cold = ids[:WARM_ADAPTERS], ids[WARM_ADAPTERS:]
    cache_line = (warm_page_cache(args.catalog) if args.page_cache == "warm"
                  else f"{residency_line(args.catalog)}, left as is (--page-cache as-is)")
    print(cache_line, flush=True)
    servers = []
    try:
        for i, (_, src) in enumerate(trees):
            servers.append(start_server(model, args.catalog, args.port + i, *serve, source=src))
        rows, profilers = [], {}
        for r in range(args.rounds):
            for i, (name, _) in enumerate(trees):
                url = f"http://127.0.0.1:{args.port + i}"
                wrk_run(url, {}, warm, 3)  # warm-up: the warm set resident, code paths hot
                groups = process_groups(servers[i].pid)  # after it: the shard hosts start on first use
                base = wrk_run(url, groups, [], args.duration)
                n = r * len(trees) + i
                fresh = cold[n * per_cold:(n + 1) * per_cold]
                if args.profile and r == args.rounds - 1:
                    hot = wrk_run(url, groups, warm, args.duration)
                    profilers = start_profile(servers[i], Path(args.profile) / f"tree{i}", args.duration - 2)
                    chill = wrk_run(url, groups, fresh, args.duration)
                    for p in profilers.values():
                        p.wait(60)
                else:
                    hot, chill = warm_cold(url, groups, warm, fresh, args.duration, args.slices)
                rows.append((r, name, base, hot, chill))
                print(f"round {r} {name}: base {base['req_per_s']:.0f}, warm {hot['req_per_s']:.0f}, "
                      f"cold {chill['req_per_s']:.0f} req/s", flush=True)
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)
    print_wrk_table(rows, serve)
    print(cache_line)
    if args.profile:
        for i in range(len(trees)):
            print(f"\n## profile of the cold run, {trees[i][0]}")
            print_profile(Path(args.profile) / f"tree{i}")


def print_wrk_table(rows, serve: list[str]) -> None:
    print(f"\nwrk c64, 2-token completions, {shlex.join(serve)}")
    print("| round | tree | base req/s | warm req/s | cold req/s | cold/warm | errors "
          "| prompt tokens computed / request, warm -> cold |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r, name, base, hot, chill in rows:
        errors = base["errors"] + hot["errors"] + chill["errors"]
        computed = (f"{hot['prompt'][1]:.1f} -> {chill['prompt'][1]:.1f} of {chill['prompt'][0]:.1f}"
                    if chill["prompt"][0] else "-")  # a tree without the prefix-cache counters
        print(f"| {r} | {name} | {base['req_per_s']:,.0f} | {hot['req_per_s']:,.0f} | "
              f"{chill['req_per_s']:,.0f} | {chill['req_per_s'] / hot['req_per_s']:.2f} | {errors} "
              f"| {computed} |")
    print("\nEach tree's rounds pooled (requests over summed wall time), and the median of its rounds")
    print("| tree | rounds | warm req/s | cold req/s | cold/warm, pooled | cold/warm, median round |")
    print("|---|---:|---:|---:|---:|---:|")
    for tree in dict.fromkeys(name for _, name, *_ in rows):
        mine = [(hot, chill) for _, name, _, hot, chill in rows if name == tree]
        hot, chill = merged([h for h, _ in mine]), merged([c for _, c in mine])
        ratios = sorted(c["req_per_s"] / h["req_per_s"] for h, c in mine)
        median = statistics.median(ratios)
        print(f"| {tree} | {len(mine)} | {hot['req_per_s']:,.0f} | {chill['req_per_s']:,.0f} | "
              f"{chill['req_per_s'] / hot['req_per_s']:.2f} | {median:.2f} |")
    roles = sorted({k for *_, hot, chill in rows for k in (*hot["cpu_ms"], *chill["cpu_ms"])})
    print("\nCPU ms per request, warm -> cold (the extra a cold request costs each process; "
          "`api main` and `core main`, the event loop and the engine thread, are part of `api` and `core`)")
    print("| round | tree | " + " | ".join(roles) + " |")
    print("|---|---|" + "---:|" * len(roles))
    for r, name, _, hot, chill in rows:
        cells = [f"{hot['cpu_ms'].get(k, 0):.2f} -> {chill['cpu_ms'].get(k, 0):.2f}" for k in roles]
        print(f"| {r} | {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["cliff", "sweep", "wrk"])
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--adapters", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--warm-seconds", type=float, default=30.0,
                    help="sweep: first serve the first 48 adapters for this long (the warm rate the sweep "
                         "is quoted against); 0: no warm phase")
    ap.add_argument("--duration-cap", type=float, default=7200.0, help="sweep: stop after this many seconds")
    ap.add_argument("--serve-args", default="", metavar="ARGS",
                    help="sweep: more `loraserve serve` arguments, e.g. '--pager-workers 1'")
    ap.add_argument("--source", metavar="DIR", action="append", dest="source_list", default=[],
                    help="sweep: serve from this source tree (A/B runs); wrk: also this tree (repeatable)")
    ap.add_argument("--rounds", type=int, default=2, help="wrk: interleaved rounds")
    ap.add_argument("--page-cache", choices=["warm", "as-is"], default="warm",
                    help="wrk: read the catalog into the OS page cache first (when it fits in half "
                         "the memory available), or leave it as this machine has it")
    ap.add_argument("--slices", type=int, default=5,
                    help="wrk: the warm and cold runs alternate in this many pieces each")
    ap.add_argument("--profile", metavar="DIR", help="sweep: py-spy the server's processes (raw stacks here)")
    ap.add_argument("--profile-seconds", type=float, default=10.0)
    ap.add_argument("--report", metavar="DIR", default=None,
                    help="loadtest reports go here (default .loraserve/reports/residency-<mode>)")
    args = ap.parse_args()
    args.report = args.report or f".loraserve/reports/residency-{args.mode}"
    args.source = args.source_list[-1] if args.source_list else None
    model = base_or_demo(args.model)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    {"cliff": cliff, "sweep": sweep, "wrk": wrk_mode}[args.mode](args, model)


if __name__ == "__main__":
    main()
