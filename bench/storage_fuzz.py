"""Storage fuzz: random damage to catalog shard files under a running `loraserve serve`.

    python bench/storage_fuzz.py --faults 1000                  # demo base, a fresh synthetic catalog
    python bench/storage_fuzz.py --faults 300 --seed 7 -- --single-process   # args after -- go to serve

A seeded generator damages one random shard's `data.mdb` at a time (overwrites at random offsets
and lengths, whole pages, the meta pages; truncations; replacement by another shard's file or by
garbage; removal; chmod 000) while one client keeps requesting random adapters. After each fault:
the server process is alive; an adapter on an undamaged shard answers 200; an adapter (or an id
that does not exist) on the damaged shard answers 200 or 503 `catalog_unavailable` (404 for the id
that does not exist; a blob failing its checksum is its revision's 500 `corrupt_blob`), never a
dropped connection or another 500. Then the original file is restored and the shard must serve
again (within `--recover-s`). At the end: /ready is 200, the engine core is the one that started.

The report: faults per kind, answers per status, recovery seconds, and what the server's log says
happened in its shard hosts (deaths by signal, quarantines). Exit status 1 when the contract broke.
`tests/server/test_storage_fuzz.py` runs the same code with a few hundred faults.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # a checkout run without an install

DATA = "data.mdb"
PAGE = 4096
KINDS = {  # kind -> weight
    "overwrite": 30, "overwrite_page": 14, "overwrite_meta": 8, "truncate": 14,
    "replace_other": 8, "replace_garbage": 8, "remove": 10, "chmod_000": 8,
}
SERVE_ARGS = ["--device", "cpu", "--max-model-len", "64", "--max-batch-size", "8", "--max-gpu-adapters", "4",
              "--max-lora-rank", "8", "--cpu-cache-mb", "1", "--kv-cache-mb", "4"]


# -- the catalog and the server ---------------------------------------------------------------------

def build_catalog(cat_dir: Path, base: Path, shards: int = 4, count: int = 48) -> tuple[dict, dict]:
    """A catalog of `count` synthetic rank-2 adapters over `base`; ({shard: [ids]}, {shard: an id
    that does not exist there})."""
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.catalog.store import Catalog

    Catalog.create(cat_dir, shards=shards).close()
    report = materialize(MaterializeConfig(cat_dir, base, count, rank=2, targets=["q_proj", "v_proj"],
                                           workers=1, progress=False))
    assert report.ok, report.errors[:3]
    with Catalog.open(cat_dir, readonly=True) as cat:
        by_shard: dict[int, list[str]] = {}
        for p in cat.list(limit=count):
            by_shard.setdefault(cat.shard_index(p.adapter_id), []).append(p.adapter_id)
        missing = {cat.shard_index(f"synth/none{i}"): f"synth/none{i}" for i in range(64)}
    assert sorted(by_shard) == list(range(shards)) and sorted(missing) == list(range(shards))
    return by_shard, missing


class Server:
    """`loraserve serve` in a child process, its log in a file; a context manager."""

    def __init__(self, base: Path, cat_dir: Path, log: Path, extra: list[str] | None = None) -> None:
        self.log = log
        args = ["serve", "--model", str(base), "--catalog", str(cat_dir), "--host", "127.0.0.1",
                "--port", "0", "--log-level", "info", *SERVE_ARGS, *(extra or [])]
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "loraserve.cli", *args], stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)
        self.url = ""

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 180
        while not self.url:
            found = re.search(r"http://127\.0\.0\.1:(\d+)", self.log.read_text())
            if found and found.group(1) != "0":
                self.url = f"http://127.0.0.1:{found.group(1)}"
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        with httpx.Client(timeout=30) as http:
            while http.get(f"{self.url}/ready").status_code != 200:
                assert time.monotonic() < deadline, "the server never got ready"
                time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def core_pid(self) -> int | None:
        """The engine core: the child started by multiprocessing's spawn (shard hosts are not)."""
        for pid in _children(self.proc.pid):
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        return None


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


# -- faults ---------------------------------------------------------------------------------------

@dataclass
class Fault:
    kind: str
    shard: int
    detail: str
    undo: object  # () -> None: puts the original file back, same inode


def _rewrite(path: Path, original: bytes):
    def undo() -> None:
        with open(path, "r+b") as f:  # same inode, same bytes, same length
            f.write(original)
            f.truncate(len(original))
    return undo


def _swap(path: Path, backup: Path):
    def undo() -> None:
        os.replace(backup, path)  # the original inode back in place
    return undo


def make_fault(rng: random.Random, cat_dir: Path, shards: int, work: Path) -> Fault:
    """Damage one random shard's data file (see module doc); the Fault says how to undo it."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    shard = rng.randrange(shards)
    path = cat_dir / f"shard-{shard:03d}" / DATA
    original = path.read_bytes()
    size = len(original)
    if kind.startswith("overwrite"):
        if kind == "overwrite_meta":
            at, n = rng.randrange(0, 2 * PAGE), rng.choice([1, 8, 64])
        elif kind == "overwrite_page":
            at, n = rng.randrange(2, size // PAGE) * PAGE, PAGE
        else:
            at, n = rng.randrange(0, size), rng.choice([1, 2, 8, 64, 512, 4096, 16384])
        garbage = rng.choice([lambda k: rng.randbytes(k), lambda k: b"\0" * k, lambda k: b"\xff" * k])(n)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(garbage[: size - at])
        return Fault(kind, shard, f"{n} bytes at {at}", _rewrite(path, original))
    if kind == "truncate":
        cut = rng.choice([0, rng.randrange(0, 2 * PAGE), rng.randrange(0, size)])
        os.truncate(path, cut)
        return Fault(kind, shard, f"to {cut} of {size} bytes", _rewrite(path, original))
    if kind == "chmod_000":
        mode = path.stat().st_mode
        path.chmod(0)
        return Fault(kind, shard, "mode 000", lambda: path.chmod(mode))
    backup = work / f"original-{shard}"
    os.link(path, backup)  # the original inode survives the fault
    if kind == "remove":
        path.unlink()
        return Fault(kind, shard, "removed", _swap(path, backup))
    fake = work / "fake"
    if kind == "replace_other":
        other = (shard + 1 + rng.randrange(shards - 1)) % shards
        shutil.copyfile(cat_dir / f"shard-{other:03d}" / DATA, fake)
        detail = f"by shard {other}'s file"
    else:
        fake.write_bytes(rng.randbytes(size))
        detail = "by garbage"
    os.replace(fake, path)
    return Fault(kind, shard, detail, _swap(path, backup))


# -- the run --------------------------------------------------------------------------------------

@dataclass
class Report:
    faults: Counter = field(default_factory=Counter)
    healthy: Counter = field(default_factory=Counter)   # answers from undamaged shards
    damaged: Counter = field(default_factory=Counter)   # answers from the damaged shard
    background: Counter = field(default_factory=Counter)  # the background client's answers
    recover_s: list[float] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)     # contract violations, in words
    log: Counter = field(default_factory=Counter)


LAST_ERROR: dict[str, str] = {}  # status -> the message of the latest answer with it


def answer(http: httpx.Client, model: str) -> str:
    """`200`, `503:catalog_unavailable`, ... or `drop` (no HTTP answer)."""
    try:
        r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0})
    except httpx.TransportError as e:
        return f"drop:{type(e).__name__}"
    if r.status_code == 200:
        return "200"
    try:
        error = r.json()["error"]
        status = f"{r.status_code}:{error['code']}"
        LAST_ERROR[status] = error["message"]
        return status
    except Exception:  # noqa: BLE001 - not an OpenAI error body
        return f"{r.status_code}:no-error-body"


ALLOWED = {"200", "503:catalog_unavailable", "500:corrupt_blob"}


def allowed(status: str, missing: bool) -> bool:
    return status in ALLOWED or (missing and status == "404:model_not_found") or \
        (missing and status.startswith("404:"))


class Background(threading.Thread):
    """One client requesting random adapters of every shard until stopped, so faults land while
    reads are in flight; its answers must be allowed ones too."""

    def __init__(self, url: str, by_shard: dict, missing: dict, report: Report, seed: int,
                 pause_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.by_shard, self.missing, self.report = url, by_shard, missing, report
        self.rng, self.stop, self.pause_s = random.Random(seed + 1), threading.Event(), pause_s

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                shard = self.rng.choice(list(self.by_shard))
                is_missing = self.rng.random() < 0.1
                model = self.missing[shard] if is_missing else self.rng.choice(self.by_shard[shard])
                status = answer(http, model)
                self.report.background[status] += 1
                if not allowed(status, is_missing):
                    self.report.broken.append(f"background {model}: {status}")
                self.stop.wait(self.pause_s)


def one_fault(http: httpx.Client, server: Server, fault: Fault, by_shard: dict, missing: dict,
              rng: random.Random, report: Report, recover_s: float) -> None:
    """The checks after one fault (module doc), then the undo and the wait for recovery."""
    healthy_shard = rng.choice([s for s in by_shard if s != fault.shard])
    status = answer(http, rng.choice(by_shard[healthy_shard]))
    report.healthy[status] += 1
    if status != "200":
        report.broken.append(f"{fault.kind} {fault.detail} on shard {fault.shard}: undamaged shard "
                             f"{healthy_shard} answered {status} ({LAST_ERROR.get(status)})")
    is_missing = rng.random() < 0.25
    model = missing[fault.shard] if is_missing else rng.choice(by_shard[fault.shard])
    status = answer(http, model)
    report.damaged[status] += 1
    if not allowed(status, is_missing):
        report.broken.append(f"{fault.kind} {fault.detail} on shard {fault.shard}: {model} answered "
                             f"{status} ({LAST_ERROR.get(status)})")
    if server.proc.poll() is not None:
        report.broken.append(f"{fault}: the server exited ({server.proc.returncode})")
        return
    fault.undo()
    start = time.monotonic()
    while (status := answer(http, rng.choice(by_shard[fault.shard]))) != "200":
        if time.monotonic() - start > recover_s:
            report.broken.append(f"{fault}: shard {fault.shard} did not serve again within {recover_s} s ({status})")
            return
        time.sleep(0.05)
    report.recover_s.append(time.monotonic() - start)


def run(server: Server, cat_dir: Path, by_shard: dict, missing: dict, faults: int, seed: int,
        work: Path, deadline_s: float = float("inf"), recover_s: float = 15.0,
        pause_s: float = 0.02) -> Report:
    """`faults` faults (or as many as fit in `deadline_s`), the background client pausing
    `pause_s` between its requests; the report."""
    rng, report = random.Random(seed), Report()
    core = server.core_pid()
    background = Background(server.url, by_shard, missing, report, seed, pause_s)
    background.start()
    start = time.monotonic()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(faults):
                if time.monotonic() - start > deadline_s or len(report.broken) > 20:
                    break
                fault = make_fault(rng, cat_dir, len(by_shard), work)
                report.faults[fault.kind] += 1
                one_fault(http, server, fault, by_shard, missing, rng, report, recover_s)
            ready = http.get("/ready")
            if ready.status_code != 200:
                time.sleep(2)  # degraded() rechecks files at most every second
                ready = http.get("/ready")
            if ready.status_code != 200:
                report.broken.append(f"/ready after the run: {ready.status_code} {ready.text[:300]}")
    finally:
        background.stop.set()
        background.join(60)
    if server.proc.poll() is not None:
        report.broken.append(f"the server exited ({server.proc.returncode})")
    if core is not None and server.core_pid() != core:
        report.broken.append(f"the engine core changed ({core} -> {server.core_pid()}): it died")
    text = server.log.read_text()
    report.log.update({
        "host deaths by signal": len(re.findall(r"was killed by SIG", text)),
        "host EFAULT exits": text.count("(EFAULT)"),
        "quarantines": text.count(" quarantined: "),
        "quarantines lifted": text.count("quarantine lifted"),
        "tracebacks": text.count("Traceback"),
    })
    return report


def print_report(report: Report, seconds: float) -> None:
    n = sum(report.faults.values())
    rec = sorted(report.recover_s) or [0.0]
    print(f"\n{n} faults in {seconds:.1f} s ({n / max(seconds, 1e-9):.1f}/s)")
    for title, counts in (("faults", report.faults), ("undamaged shard", report.healthy),
                          ("damaged shard", report.damaged), ("background client", report.background),
                          ("server log", report.log)):
        print(f"  {title:<18} " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    print(f"  recovery s         p50 {rec[len(rec) // 2]:.2f}  max {rec[-1]:.2f}")
    print(f"  contract           {'kept' if not report.broken else 'BROKEN'}")
    for line in report.broken[:20]:
        print(f"    {line}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--adapters", type=int, default=48)
    p.add_argument("--model", default=None, help="base model directory (default: the demo base)")
    p.add_argument("--work", default="/tmp/loraserve-storage-fuzz")
    p.add_argument("serve_args", nargs="*", help="after --: more `loraserve serve` arguments")
    args = p.parse_args()
    from _common import base_or_demo

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base = Path(base_or_demo(args.model))
    by_shard, missing = build_catalog(work / "catalog", base, args.shards, args.adapters)
    start = time.monotonic()
    with Server(base, work / "catalog", work / "server.log", args.serve_args) as server:
        report = run(server, work / "catalog", by_shard, missing, args.faults, args.seed, work)
    print_report(report, time.monotonic() - start)
    return 1 if report.broken else 0


if __name__ == "__main__":
    sys.exit(main())
