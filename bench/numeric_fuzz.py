"""The numeric fuzz's long run: many seeded rounds of hostile adapters over one long-running engine.

    python bench/numeric_fuzz.py [--rounds 200] [--per-round 8] [--seed 0] [--backend torch|triton]
                                 [--defences all|runtime-only] [--model DIR]

The same generator and property as `tests/lora/test_numeric_fuzz.py` (which runs a few seeded
rounds in `make test`): heavy-tailed adapter factors (Cauchy up to 1e6, +-1e30 spikes, 1e19
fills, float16's largest value, subnormals, NaN) written behind the writers' back, random
mixed-length batches, a small KV cache of small blocks handed out in random order. Every request
on the base or a tame adapter must finish with its solo run's tokens and logprobs (on a clean
engine); every other request finishes or is refused with a named error. `runtime-only` takes the
entry checks and the block scrub away, leaving the null KV block and the per-row screen.
Prints a table per round block and a summary; exits 1 on the first violation.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))  # the fuzz's generator and base builder
sys.path.append(str(ROOT / "tests" / "lora"))

import argparse
import shutil
import tempfile
import time
from collections import deque

import numpy as np


def _base(model: str | None, root: Path) -> Path:
    if model:
        return Path(model)
    import conftest  # tests/conftest.py: the tiny transformers-written Qwen3 the tests use
    from loraserve.demo import build_demo_base

    demo = build_demo_base(root / "demo", arch="qwen3", seed=0)
    return conftest._hf_base(root, demo, "qwen3")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--per-round", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="torch", choices=["torch", "triton"])
    p.add_argument("--defences", default="all", choices=["all", "runtime-only"])
    p.add_argument("--model", default=None)
    args = p.parse_args()
    import test_numeric_fuzz as fuzz
    import torch

    from loraserve.catalog.base import BaseInfo
    from loraserve.catalog.layout import save_revision
    from loraserve.catalog.store import Catalog

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="numeric-fuzz-"))
    try:
        base_dir = _base(args.model, root)
        base = BaseInfo.from_dir(base_dir)
        plan, styles = fuzz._plan(args.rounds, args.per_round, args.seed, base)
        with Catalog.create(root / "catalog", shards=4) as cat:
            for new, _ in plan:
                for aid, (_, weights) in new.items():
                    cat.put_revision(aid, save_revision(weights, check=False))
        shutil.copytree(root / "catalog", root / "clean")
        eng = fuzz._engine(str(base_dir), str(root / "catalog"), args.backend)
        clean = fuzz._engine(str(base_dir), str(root / "clean"), args.backend)
        if args.defences == "runtime-only":
            import loraserve.adapters.pager as pager_mod
            real = pager_mod.load_revision
            pager_mod.load_revision = lambda blob, **kw: real(blob, what=kw.get("what", ""))
            eng.cache.scrub = lambda blocks: None
        eng.blocks._free = deque(int(b) for b in np.random.default_rng(args.seed).permutation(eng.blocks.num_blocks))
        counts = {"tame ok": 0, "hostile ok": 0, "hostile refused": 0}
        start = time.monotonic()
        print(f"{'rounds':>7} {'requests':>9} {'tame ok':>8} {'hostile ok':>11} {'refused':>8} "
              f"{'quarantined':>12} {'s':>7}")
        for r, (_, reqs) in enumerate(plan, 1):
            got = fuzz._run(eng, reqs)
            eng.blocks.check_invariants([])
            for req in reqs:
                tokens, lps, err = got[req.request_id]
                if req.adapter is None or styles[req.adapter] in fuzz.TAME:
                    solo = fuzz._run(clean, [req])[req.request_id]
                    if err is not None or tokens != solo[0] or not np.allclose(lps, solo[1], rtol=0, atol=1e-4):
                        print(f"VIOLATION round {r} {req.request_id} ({req.adapter}): {err!r} "
                              f"{tokens} vs solo {solo[0]}")
                        return 1
                    counts["tame ok"] += 1
                elif err is not None:
                    if fuzz._code(err) not in fuzz.REFUSALS:
                        print(f"VIOLATION round {r} {req.request_id}: unexpected error {err!r}")
                        return 1
                    counts["hostile refused"] += 1
                else:
                    counts["hostile ok"] += 1
            if r % max(1, args.rounds // 10) == 0 or r == args.rounds:
                print(f"{r:>7} {r * args.per_round:>9} {counts['tame ok']:>8} {counts['hostile ok']:>11} "
                      f"{counts['hostile refused']:>8} {len(eng.snapshot.quarantined):>12} "
                      f"{time.monotonic() - start:>7.1f}")
        print("no violation")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
