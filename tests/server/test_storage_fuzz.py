"""Storage fuzz under a real server (issue 22): hundreds of random overwrites, truncations,
replacements and removals of shard files while `loraserve serve` runs. The server process (and
its engine core) survives every one, the other shards serve, the damaged shard answers 200 or
503 (404 for an id that does not exist there; a blob failing its checksum is its revision's
500 `corrupt_blob`), never a dropped connection or another 500, and it serves again once its
file is restored. The driver is `bench/storage_fuzz.py` (a long run: `--faults 1000`)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "storage_fuzz.py"
FAULT_SECONDS = 30  # of faults (about 200 on an idle 2-core machine); with the server start, about a minute


def load_driver():
    spec = importlib.util.spec_from_file_location("storage_fuzz", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_storage_faults_never_reach_a_serving_process(demo_dense, tmp_path) -> None:
    fuzz = load_driver()
    cat_dir = tmp_path / "catalog"
    by_shard, missing = fuzz.build_catalog(cat_dir, demo_dense, shards=4, count=48)
    with fuzz.Server(demo_dense, cat_dir, tmp_path / "server.log") as server:
        report = fuzz.run(server, cat_dir, by_shard, missing, faults=1000, seed=0, work=tmp_path,
                          deadline_s=FAULT_SECONDS)
    fuzz.print_report(report, FAULT_SECONDS)  # shown with -s, or when the test fails
    assert not report.broken, report.broken[:10]
    assert sum(report.faults.values()) >= 100, report.faults
    assert report.healthy == {"200": sum(report.faults.values())}
    assert report.damaged["503:catalog_unavailable"] > 0 and report.damaged["200"] > 0
    assert report.log["tracebacks"] == 0
