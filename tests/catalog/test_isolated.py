"""IsolatedCatalog: a storage fault in a shard fails that shard's requests (ShardUnavailable, 503),
never the process that owns the catalog; the other shards serve on, and the shard serves again
once its file is restored.

A read of a garbage page is a signal in the process that maps the shard. Here the shards are
mapped by shard hosts: a host that dies takes only its request in flight with it (its shard is
quarantined and probed again), requests queued for its other shards go to its replacement.
The real signal, for certain: a file cut while a read of its pages is in flight (SIGBUS; the same
read in-process ends the process). `hosted_fns.crash` stands for any other fatal read (the LMDB
build here refuses most garbage pages with MDB_CORRUPTED, which quarantines the shard too).
"""
from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import hosted_fns
from loraserve.catalog.aliases import lookup_alias, record_alias
from loraserve.catalog.errors import AdapterNotFound, CorruptBlob, RevisionNotFound, ShardUnavailable
from loraserve.catalog.isolated import IsolatedCatalog, open_for_serving
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.store import Catalog

SHARDS = 3
FAST = dict(probe_backoff_s=(0.2, 1.0))


def blob(seed: int, hidden: int = 256, rank: int = 8) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.q_proj.lora_A": torch.randn(rank, hidden, generator=g),
         "layers.0.self_attn.q_proj.lora_B": torch.randn(hidden, rank, generator=g)}
    return save_revision(AdapterWeights("fp", rank, ["q_proj"], torch.float32, t, "test"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A catalog with 8 adapters in each shard (built once; tests work on copies)."""
    cat_dir = tmp_path_factory.mktemp("iso") / "cat"
    by_shard: dict[int, list[str]] = {s: [] for s in range(SHARDS)}
    blobs = {}
    with Catalog.create(cat_dir, shards=SHARDS) as cat:
        i = 0
        while min(len(v) for v in by_shard.values()) < 8:
            aid, s = f"acme/a{i}", cat.shard_index(f"acme/a{i}")
            if len(by_shard[s]) < 8:
                blobs[aid] = blob(i)
                cat.put_revision(aid, blobs[aid])
                by_shard[s].append(aid)
            i += 1
    missing = {cat.shard_index(f"acme/none{i}"): f"acme/none{i}" for i in range(40)}
    return cat_dir, by_shard, blobs, missing


@pytest.fixture
def filled(built, tmp_path):
    cat_dir, by_shard, blobs, missing = built
    shutil.copytree(cat_dir, tmp_path / "cat")
    return tmp_path / "cat", by_shard, blobs, missing


def data_file(cat_dir, shard: int):
    return cat_dir / f"shard-{shard:03d}" / "data.mdb"


def serves(cat, aid: str, blobs: dict) -> bool:
    return cat.read_blob(cat.resolve(aid)) == blobs[aid]


def eventually_serves(cat, aid: str, blobs: dict, within_s: float = 10.0) -> float:
    """Seconds until `aid` serves again (the prober lifts the quarantine)."""
    start = time.monotonic()
    while True:
        try:
            if serves(cat, aid, blobs):
                return time.monotonic() - start
        except ShardUnavailable:
            pass
        assert time.monotonic() - start < within_s, f"{aid} did not serve again within {within_s} s"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """The process is neither running nor a zombie (it was reaped)."""
    return not os.path.exists(f"/proc/{pid}")


def test_same_answers_as_the_in_process_catalog(filled) -> None:
    cat_dir, by_shard, blobs, missing = filled
    with Catalog.open(cat_dir) as plain, IsolatedCatalog(cat_dir, hosts=2) as iso:
        aid = by_shard[1][0]
        assert iso.resolve(aid) == plain.resolve(aid) and serves(iso, aid, blobs)
        assert iso.policy(aid) == plain.policy(aid)
        assert [p.adapter_id for p in iso.list(limit=5, after="acme/a3")] == \
            [p.adapter_id for p in plain.list(limit=5, after="acme/a3")]
        assert iso.stats() == plain.stats()
        with pytest.raises(AdapterNotFound):
            iso.resolve(missing[0])
        with pytest.raises(RevisionNotFound):
            iso.resolve(aid, "r9")
        rec = iso.put_revision(aid, blob(100), promote=False)
        assert rec.revision == "r2" and iso.resolve(aid).revision == "r1"  # the write bumped the generation
        assert iso.promote(aid, "r2").promoted == "r2" and iso.resolve(aid).revision == "r2"
        assert iso.tag(aid, "stable", "r1").tags == {"stable": "r1"} and iso.rollback(aid).promoted == "r1"
        assert plain.resolve(aid, "stable").revision == "r1"  # written through the host, seen here
        record_alias(plain, "tinker://run/x", aid, "r2")
        assert lookup_alias(iso, "tinker://run/x") == f"{aid}@r2"
        got = iso.read_blobs([iso.resolve(a) for a in by_shard[0][:3]] + [rec])
        assert [bytes(b) for b in got] == [blobs[a] for a in by_shard[0][:3]] + [blob(100)]
        assert all(isinstance(b, bytearray) for b in got)


def test_a_host_that_dies_fails_its_shard_alone(filled) -> None:
    cat_dir, by_shard, blobs, missing = filled
    with IsolatedCatalog(cat_dir, hosts=1, **FAST) as cat:  # every shard in one host
        assert all(serves(cat, a, blobs) for ids in by_shard.values() for a in ids)
        [pid] = cat.host_pids()
        with pytest.raises(ShardUnavailable, match=r"shard 1 .*killed by SIGSEGV during a read") as e:
            cat.shard(1).read(hosted_fns.crash)
        assert e.value.status == 503 and e.value.shards == [1] and gone(pid)
        for aid in [*by_shard[1], missing[1]]:  # resolved before or never, existing or not
            with pytest.raises(ShardUnavailable, match="shard 1 .*quarantined|shard 1 .*SIGSEGV"):
                cat.read_blob(cat.resolve(aid))
        assert cat.degraded_shards(max_age=0) == [1] and "SIGSEGV" in cat.degraded()[1]
        assert all(serves(cat, a, blobs) for s in (0, 2) for a in by_shard[s])  # a new host
        assert cat.host_pids() and cat.host_pids() != [pid]
        with pytest.raises(ShardUnavailable, match="listing needs every shard; unavailable: 1"):
            cat.list(limit=1000)
        time.sleep(1.5)  # probes replay the read that killed the host: still quarantined
        assert cat.degraded_shards(max_age=0) == [1]
        pids = set(cat.host_pids())
    assert all(gone(p) for p in pids)  # closed and reaped


def test_requests_queued_behind_a_dying_host_go_to_its_replacement(filled) -> None:
    cat_dir, by_shard, blobs, _ = filled
    with IsolatedCatalog(cat_dir, hosts=1, **FAST) as cat:
        cat.resolve(by_shard[0][0])  # the host is up
        results: dict[str, object] = {}

        def run(name: str, fn) -> None:
            try:
                results[name] = fn()
            except Exception as e:  # noqa: BLE001 - checked below
                results[name] = e

        crash = threading.Thread(target=run, args=("crash", lambda: cat.shard(1).read(
            functools.partial(hosted_fns.crash, delay=0.5))))
        crash.start()
        time.sleep(0.2)  # the crash request holds the host; these queue behind it
        others = [threading.Thread(target=run, args=(f"{s}:{a}", functools.partial(serves, cat, a, blobs)))
                  for s in (0, 2) for a in by_shard[s][:3]]
        others.append(threading.Thread(target=run, args=("blobs", lambda: cat.read_blobs(
            [cat.resolve(a) for a in by_shard[2][3:6]]))))
        for t in others:
            t.start()
        for t in [crash, *others]:
            t.join(30)
        assert isinstance(results.pop("crash"), ShardUnavailable)
        blobs_got = results.pop("blobs")
        assert [bytes(b) for b in blobs_got] == [blobs[a] for a in by_shard[2][3:6]]
        assert results and all(v is True for v in results.values()), results


def test_a_pipelined_exchange_says_which_requests_ran_when_its_host_dies(filled) -> None:
    """`ShardHost.call_many` sends a batch's requests ahead: those before the one
    the host died on answered, that one is lost, those after never ran (sent again by callers);
    a host killed while idle is replaced for the whole next batch."""
    cat_dir, by_shard, _, _ = filled
    with IsolatedCatalog(cat_dir, hosts=1, **FAST) as cat:
        cat.resolve(by_shard[0][0])  # the host is up
        host, [pid] = cat.shard(0).host, cat.host_pids()
        read = ("read", 0, (hosted_fns.host_pid, None))
        crash = ("read", 0, (hosted_fns.crash, None))
        replies = host.call_many([read, read, crash, read, read])
        assert replies[:2] == [("ok", pid)] * 2, replies
        assert replies[2][0] == "lost" and replies[3:] == [("unsent", None)] * 2, replies
        assert gone(pid)
        replies = host.call_many([read] * 6)  # its replacement takes all six
        [new] = {value for _, value in replies}
        assert [kind for kind, _ in replies] == ["ok"] * 6 and new != pid
        os.kill(new, signal.SIGKILL)
        while not gone(new) and Path(f"/proc/{new}/stat").read_text().split()[2] != "Z":
            time.sleep(0.01)  # dead (a zombie until the owner reaps it)
        replies = host.call_many([read] * 3)  # died idle: the batch goes to the next host whole
        assert [kind for kind, _ in replies] == ["ok"] * 3 and replies[0][1] not in (pid, new)


def test_a_host_that_hangs_is_killed_after_the_timeout(filled) -> None:
    cat_dir, by_shard, blobs, _ = filled
    with IsolatedCatalog(cat_dir, hosts=1, timeout_s=1.0, **FAST) as cat:
        start = time.monotonic()
        with pytest.raises(ShardUnavailable, match=r"shard 0 .*did not answer within 1 s and was killed"):
            cat.shard(0).read(functools.partial(hosted_fns.hang, seconds=60))
        assert time.monotonic() - start < 10
        assert serves(cat, by_shard[2][0], blobs) and cat.degraded_shards() == [0]


def overwrite_tree(path, seed: int) -> bytes:
    """Garbage over every page but the two meta pages, size unchanged; the old bytes."""
    old = path.read_bytes()
    with open(path, "r+b") as f:
        f.seek(8192)
        f.write(random.Random(seed).randbytes(len(old) - 8192))
    return old


def restore(path, content: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(content)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_shard_overwritten_with_garbage_fails_alone_then_recovers(filled, warm: bool) -> None:
    cat_dir, by_shard, blobs, missing = filled
    with IsolatedCatalog(cat_dir, hosts=2, **FAST) as cat:
        if warm:  # resolved, blobs read, env mapped: cached answers must not hide the damage
            assert all(serves(cat, a, blobs) for ids in by_shard.values() for a in ids)
        old = overwrite_tree(data_file(cat_dir, 1), seed=1)
        with pytest.raises(ShardUnavailable, match="shard 1 "):
            cat.resolve(missing[1])  # never existed: not a 404 from a damaged shard
        for aid in by_shard[1]:
            with pytest.raises(ShardUnavailable, match="shard 1 "):
                cat.read_blob(cat.resolve(aid))
        assert cat.degraded_shards(max_age=0) == [1]
        assert all(serves(cat, a, blobs) for s in (0, 2) for a in by_shard[s])
        restore(data_file(cat_dir, 1), old)
        eventually_serves(cat, by_shard[1][0], blobs)
        assert all(serves(cat, a, blobs) for a in by_shard[1])
        with pytest.raises(AdapterNotFound):
            cat.resolve(missing[1])
        assert cat.degraded_shards(max_age=0) == []


def test_a_file_cut_under_a_read_in_flight_kills_the_host_not_the_owner(filled) -> None:
    """The real fault, with certainty: a blob read whose pages leave the file while it runs is
    SIGBUS in the process that maps it."""
    cat_dir, by_shard, blobs, _ = filled
    path, aid = data_file(cat_dir, 1), by_shard[1][0]
    with IsolatedCatalog(cat_dir, hosts=1, **FAST) as cat:
        ref = cat.resolve(aid).ref.encode()
        original = path.read_bytes()
        cutter = threading.Timer(0.5, os.truncate, (path, 8192))
        cutter.start()
        with pytest.raises(ShardUnavailable, match=r"shard 1 .*killed by SIGBUS during a read"):
            cat.shard(1).read(functools.partial(hosted_fns.read_late, key=ref, delay=1.0))
        cutter.join()
        assert serves(cat, by_shard[0][0], blobs) and cat.degraded_shards(max_age=0) == [1]
        restore(path, original)
        eventually_serves(cat, aid, blobs)  # the probe replays that read: it passes now


IN_PROCESS = """
import functools, os, sys, threading
import hosted_fns
from loraserve.catalog.store import Catalog
cat = Catalog.open(sys.argv[1])
ref = cat.resolve(sys.argv[2]).ref.encode()
threading.Timer(0.5, os.truncate, (sys.argv[3], 8192)).start()
cat.shard(int(sys.argv[4])).read(functools.partial(hosted_fns.read_late, key=ref, delay=1.0))
"""


def test_the_same_read_in_process_ends_the_process(filled) -> None:
    """Why the hosts: the in-process catalog, same fault, same read, dies of SIGBUS."""
    cat_dir, by_shard, _, _ = filled
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, str(cat_dir), by_shard[1][0],
                           str(data_file(cat_dir, 1)), "1"], cwd=Path(hosted_fns.__file__).parent,
                          capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGBUS, done.stderr[-2000:]


def test_truncation_under_readers_never_reaches_the_owner(filled) -> None:
    """Truncating a shard while blobs are read from it is SIGBUS for the process that maps it;
    here every read answers, the other shards serve throughout, and the shard recovers."""
    cat_dir, by_shard, blobs, _ = filled
    path = data_file(cat_dir, 1)
    original = path.read_bytes()
    with IsolatedCatalog(cat_dir, hosts=1, **FAST) as cat:
        records = [cat.resolve(a) for a in by_shard[1]]
        stop, seen, bad = threading.Event(), {"ok": 0, "503": 0}, []

        def reader() -> None:
            while not stop.is_set():
                for got in cat.read_blobs(records):
                    if isinstance(got, ShardUnavailable):
                        seen["503"] += 1
                    elif isinstance(got, (bytes, bytearray)):
                        seen["ok"] += 1
                    else:
                        bad.append(got)

        t = threading.Thread(target=reader)
        t.start()
        try:
            for i in range(60):
                os.truncate(path, 8192)
                time.sleep(0.002)
                restore(path, original)
                if i % 10 == 0:
                    assert serves(cat, by_shard[0][i % 8], blobs)
                time.sleep(0.002)
        finally:
            stop.set()
            t.join(30)
        assert not bad, bad[:3]
        eventually_serves(cat, by_shard[1][0], blobs)
        assert seen["ok"] + seen["503"] > 0


def test_a_write_the_os_refuses_is_503_and_reads_go_on(filled) -> None:
    cat_dir, by_shard, blobs, _ = filled
    aid = by_shard[2][0]
    with IsolatedCatalog(cat_dir, hosts=1) as cat:
        cat.put_revision(aid, blob(200), promote=False)  # the env is open read-write
        if subprocess.run(["chattr", "+i", str(data_file(cat_dir, 2))], capture_output=True).returncode:
            pytest.skip("chattr +i is not available here (needs root and a file system with it)")
        try:
            with pytest.raises(ShardUnavailable, match="shard 2 .*write refused.*not permitted") as e:
                cat.promote(aid, "r2")
            assert e.value.status == 503 and e.value.shards == [2]
            assert serves(cat, aid, blobs) and cat.degraded_shards(max_age=0) == []  # not quarantined
        finally:
            subprocess.run(["chattr", "-i", str(data_file(cat_dir, 2))], check=True)
        assert cat.promote(aid, "r2").promoted == "r2"


def test_a_corrupt_blob_stays_a_revision_error(filled) -> None:
    """A blob failing its checksum is that revision's CorruptBlob (as in-process), not the shard's."""
    cat_dir, by_shard, blobs, _ = filled
    aid = by_shard[0][0]
    with IsolatedCatalog(cat_dir, hosts=1) as cat:
        record = cat.resolve(aid)
        with Catalog.open(cat_dir) as plain:  # plant bad bytes of the right length
            bad = bytes([blobs[aid][0] ^ 1]) + blobs[aid][1:]
            plain.shard(0).write(lambda txn, dbs: txn.put(record.ref.encode(), bad, db=dbs.blob))
        with pytest.raises(CorruptBlob, match="checksum"):
            cat.read_blob(record)
        assert serves(cat, by_shard[0][1], blobs) and cat.degraded_shards(max_age=0) == []


def test_hosts_env_switch(filled, monkeypatch) -> None:
    cat_dir = filled[0]
    monkeypatch.setenv("LORASERVE_CATALOG_HOSTS", "0")
    with open_for_serving(cat_dir) as cat:
        assert type(cat) is Catalog
    monkeypatch.setenv("LORASERVE_CATALOG_HOSTS", "2")
    with open_for_serving(cat_dir, readonly=True) as cat:
        assert isinstance(cat, IsolatedCatalog) and len(cat.hosts) == 2


def test_a_data_file_removed_before_its_first_use_is_503_not_404(filled) -> None:
    """The files there when the catalog opens are the shards': one gone later is a fault, not a
    shard that was never written (whose ids would all be 404)."""
    cat_dir, by_shard, blobs, _ = filled
    path, backup = data_file(cat_dir, 1), cat_dir / "kept"
    with IsolatedCatalog(cat_dir, hosts=1) as cat:
        os.link(path, backup)
        path.unlink()
        with pytest.raises(ShardUnavailable, match="shard 1 .*removed"):
            cat.resolve(by_shard[1][0])
        os.replace(backup, path)
        assert serves(cat, by_shard[1][0], blobs)
