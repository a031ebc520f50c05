"""Bulk materialize: exact counts, determinism, kill + rerun, readers during writes, no orphans."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import CatalogError
from loraserve.catalog.format import blob_checksum
from loraserve.catalog.layout import load_revision
from loraserve.catalog.materialize import MaterializeConfig, materialize
from loraserve.catalog.store import Catalog
from loraserve.catalog.synth import build_template, target_modules

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg(cat_dir, base, count, **kw):
    return MaterializeConfig(cat_dir, base, count, progress=False, **kw)


def test_materialize_counts_rerun_and_determinism(dense_base, tmp_path):
    Catalog.create(tmp_path / "cat", shards=6).close()
    rep = materialize(cfg(tmp_path / "cat", dense_base, 250, rank=2, targets=["q_proj", "v_proj"], workers=2, batch=40))
    assert rep.ok and (rep.written, rep.skipped) == (250, 0)
    again = materialize(cfg(tmp_path / "cat", dense_base, 250, rank=2, workers=2, batch=40))
    assert again.ok and (again.written, again.skipped) == (0, 250)
    base = BaseInfo.from_dir(dense_base)
    template = build_template(target_modules(base.modules, ["q_proj", "v_proj"]), 2, ["q_proj", "v_proj"],
                              "float32", base.fingerprint)
    with Catalog.open(tmp_path / "cat", readonly=True) as cat:
        st = cat.stats()
        assert (st["adapters"], st["revisions"]) == (250, 250)
        assert len({r["shard"] for r in st["per_shard"] if r["adapters"]}) == 6
        rec = cat.resolve("synth/a0000123")
        blob = cat.read_blob(rec)
        assert blob == template.blob("synth/a0000123", seed=0)  # same bytes whichever batch built it
        assert rec.checksum == blob_checksum(blob) and rec.base_fingerprint == base.fingerprint
        w = load_revision(blob)
        assert w.rank == 2 and w.tensors["layers.1.self_attn.v_proj.lora_B"].shape == (16, 2)
        assert [p.adapter_id for p in cat.list("synth/", limit=3)] == ["synth/a0000000", "synth/a0000001", "synth/a0000002"]


def test_materialize_bfloat16_and_moe(moe_base, tmp_path):
    Catalog.create(tmp_path / "cat", shards=2).close()
    rep = materialize(cfg(tmp_path / "cat", moe_base, 10, rank=3, targets=["k_proj", "experts.down_proj"],
                          dtype="bfloat16", workers=1, prefix="moe/x"))
    assert rep.ok and rep.written == 10
    with Catalog.open(tmp_path / "cat", readonly=True) as cat:
        w = load_revision(cat.read_blob(cat.resolve("moe/x0000004")))
    assert w.tensors["layers.0.mlp.experts.down_proj.lora_A"].shape == (4, 3, 12)
    assert str(w.dtype) == "torch.bfloat16" and w.tensors["layers.0.self_attn.k_proj.lora_B"].abs().sum() > 0


def test_materialize_rejects_bad_config(dense_base, tmp_path):
    with pytest.raises(ValueError):
        cfg(tmp_path, dense_base, 10, targets="q_proj,nope")
    with pytest.raises(Exception, match="invalid"):
        cfg(tmp_path, dense_base, 10, prefix="bad prefix/")


def test_rerun_over_a_shard_killed_while_being_created(dense_base, tmp_path):
    """A worker killed inside LMDB's creation of a shard leaves a zero-length data file; a rerun
    finishes over it (LMDB initializes it), and readers meanwhile see that shard as empty."""
    Catalog.create(tmp_path / "cat", shards=2).close()
    (tmp_path / "cat" / "shard-001").mkdir()
    (tmp_path / "cat" / "shard-001" / "data.mdb").touch()
    with Catalog.open(tmp_path / "cat", readonly=True) as cat:
        assert cat.stats()["adapters"] == 0 and cat.degraded_shards() == []
    rep = materialize(cfg(tmp_path / "cat", dense_base, 20, workers=2))
    assert rep.ok and rep.written == 20
    with Catalog.open(tmp_path / "cat", readonly=True) as cat:
        assert cat.stats()["adapters"] == 20


def _materialize_cmd(cat_dir, base, count):
    code = ("import sys; from loraserve.cli_catalog import run; sys.exit(run(sys.argv[1:]))")
    return [sys.executable, "-c", code, "catalog", "materialize", str(cat_dir), "--model", str(base),
            "--count", str(count), "--workers", "2", "--batch", "25", "--shards", "4", "--no-progress"]


def _adapters_seen(cat_dir) -> int:
    """Adapters a reader sees now; 0 while the catalog or a shard is still being created (a shard
    file shorter than its meta pages for a moment reads as unavailable)."""
    if not (cat_dir / "catalog.json").exists():
        return 0
    try:
        with Catalog.open(cat_dir, readonly=True) as cat:
            return cat.stats()["adapters"]
    except CatalogError:
        return 0


def _wait_for_adapters(proc, cat_dir, timeout_s: float = 300) -> int:
    """Poll (as a reader, while the workers write) until some adapters exist; how many."""
    deadline = time.monotonic() + timeout_s  # generous: the CLI imports torch, slow on a loaded machine
    while time.monotonic() < deadline and proc.poll() is None:
        if (seen := _adapters_seen(cat_dir)) > 0:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"no adapters appeared (materialize exited with {proc.poll()})")


def test_killed_midway_then_rerun_gives_exactly_n(dense_base, tmp_path):
    n, cat_dir = 30000, tmp_path / "cat"
    proc = subprocess.Popen(_materialize_cmd(cat_dir, dense_base, n), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_adapters(proc, cat_dir)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the CLI and its workers
        proc.wait()
    with Catalog.open(cat_dir, readonly=True) as cat:
        partial = cat.stats()
    assert 0 < partial["adapters"] < n and partial["adapters"] == partial["revisions"]
    done = subprocess.run(_materialize_cmd(cat_dir, dense_base, n), cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 build errors" in done.stdout
    with Catalog.open(cat_dir, readonly=True) as cat:
        st = cat.stats()
        ids = [p.adapter_id for p in cat.list("synth/", limit=n + 10)]
        size = cat.resolve(ids[0]).size
    assert (st["adapters"], st["revisions"]) == (n, n)
    assert ids == [f"synth/a{i:07d}" for i in range(n)]
    assert st["bytes"] == n * size


def _children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_workers_exit_when_the_parent_is_killed(dense_base, tmp_path):
    n, cat_dir = 30000, tmp_path / "cat"
    proc = subprocess.Popen(_materialize_cmd(cat_dir, dense_base, n), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_adapters(proc, cat_dir)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers  # --workers 2
        proc.kill()  # kill -9 of the parent alone, not its process group
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers), "materialize workers outlived their parent"
        settled = _adapters_seen(cat_dir)
        time.sleep(0.5)
        assert _adapters_seen(cat_dir) == settled < n  # nobody writes any more
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leave nothing behind even when the test fails
        except ProcessLookupError:
            pass


WATCHDOG_PARENT = r"""
import os, time
import loraserve.catalog.materialize_worker as worker
worker._set_parent_death_signal = lambda sig: False  # as where prctl is missing: the watchdog thread
parent = os.getpid()
child = os.fork()
if child == 0:
    worker.exit_with_parent(parent)
    while True:
        time.sleep(0.1)
print(child, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_watchdog_fallback_ends_an_orphan(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WATCHDOG_PARENT], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the watchdog did not end the orphaned worker"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_listing_pages_merge_the_shards_exactly(dense_base, tmp_path):
    """`Catalog.list` reads about `limit` records per page (a merge of the shards' key ranges,
    re-asking a shard only while it could still hold a key of the page): every page size, prefix
    and `after` gives exactly the brute-force answer: all ids sorted, filtered, sliced."""
    Catalog.create(tmp_path / "cat", shards=7).close()
    assert materialize(cfg(tmp_path / "cat", dense_base, 300, rank=1, workers=1, prefix="p/a")).ok
    assert materialize(cfg(tmp_path / "cat", dense_base, 40, rank=1, workers=1, prefix="q/b")).ok
    with Catalog.open(tmp_path / "cat", readonly=True) as cat:
        every = sorted(p.adapter_id for p in cat.list(limit=10_000))
        assert len(every) == 340
        for prefix in ("", "p/", "q/", "p/a00001", "zz"):
            want = [i for i in every if i.startswith(prefix)]
            for limit in (1, 3, 7, 50, 339, 400):
                got, after = [], None
                while True:
                    page = [p.adapter_id for p in cat.list(prefix, limit=limit, after=after)]
                    assert len(page) <= limit
                    got += page
                    if len(page) < limit:
                        break
                    after = page[-1]
                assert got == want, (prefix, limit)
        assert cat.list(limit=0) == []
        assert [p.adapter_id for p in cat.list(limit=2, after="p/a0000298")] == ["p/a0000299", "q/b0000000"]
