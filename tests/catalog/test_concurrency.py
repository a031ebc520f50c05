"""Readers in another process keep reading verified blobs while a writer writes and grows the map."""
import json
import os
import subprocess
import sys

import torch

from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.shards import MiB, ShardOptions
from loraserve.catalog.store import Catalog

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READER = r"""
import json, sys, random
from pathlib import Path
from loraserve.catalog.layout import load_revision
from loraserve.catalog.store import Catalog
cat_dir, stop = sys.argv[1], Path(sys.argv[2])
reads, errors, rng = 0, [], random.Random(0)
with Catalog.open(cat_dir, readonly=True) as cat:
    print("ready", flush=True)
    while not stop.exists() or reads < 50:
        aid = f"acme/base{rng.randrange(20)}"
        try:
            rec = cat.resolve(aid)
            load_revision(cat.read_blob(rec))
            reads += 1
        except Exception as e:
            errors.append(f"{aid}: {type(e).__name__}: {e}")
print(json.dumps({"reads": reads, "errors": errors[:5]}), flush=True)
"""


def blob(seed: int, hidden: int = 64, rank: int = 8) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = {"layers.0.self_attn.v_proj.lora_A": torch.randn(rank, hidden, generator=g),
         "layers.0.self_attn.v_proj.lora_B": torch.randn(hidden, rank, generator=g)}
    return save_revision(AdapterWeights("fp", rank, ["v_proj"], torch.float32, t))


def test_reader_process_during_writes_and_map_growth(tmp_path):
    opts = ShardOptions(initial_map_size=1 * MiB)
    cat_dir, stop = tmp_path / "cat", tmp_path / "stop"
    with Catalog.create(cat_dir, shards=2, options=opts) as cat:
        for i in range(20):
            cat.put_revision(f"acme/base{i}", blob(i))
        reader = subprocess.Popen([sys.executable, "-c", READER, str(cat_dir), str(stop)], cwd=REPO,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline().strip() == "ready"
            for i in range(150):  # new adapters + new promoted revisions of the ones being read
                cat.put_revision(f"acme/new{i}", blob(1000 + i))
                cat.put_revision(f"acme/base{i % 20}", blob(2000 + i))
            grown = max(cat.shard(s).stats()["map_size"] for s in range(2))
        finally:
            stop.touch()
            out, _ = reader.communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["errors"] == [] and result["reads"] >= 50
    assert grown > 1 * MiB  # the writer grew the map while the reader had it open
