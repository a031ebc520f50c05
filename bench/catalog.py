"""Catalog benchmarks: bulk materialize + audit, point reads, packed MoE loading, adapter-only handoff.

    python bench/catalog.py materialize --count 1000000   # demo base, rank-1 q_proj,v_proj, 100 shards, then audit 256
    python bench/catalog.py reads --catalog DIR            # p50/p99 of record lookup and blob read + checksum
    python bench/catalog.py moe                            # packed vs per-expert MoE LoRA loading (Qwen3-30B-A3B dims, r16)
    python bench/catalog.py handoff                        # adapter-only vs merged-checkpoint handoff (Qwen3-4B dims, r32)
    python bench/catalog.py containment --count 20000      # resolve hit / miss, read_blobs: in-process vs shard hosts
Each prints a table; nothing is asserted. Work files go under --work (default /tmp/loraserve-bench).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from loraserve.catalog.base import BaseInfo  # noqa: E402
from loraserve.catalog.export import export_peft  # noqa: E402
from loraserve.catalog.layout import load_revision, save_revision  # noqa: E402
from loraserve.catalog.materialize import MaterializeConfig, materialize  # noqa: E402
from loraserve.catalog.store import Catalog  # noqa: E402


def table(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}")
    width = max(len(str(r[0])) for r in rows)
    for r in rows:
        print(f"  {str(r[0]):<{width}}  " + "  ".join(str(c) for c in r[1:]))


def bench_materialize(args) -> None:
    from loraserve.audit import run_audit
    from loraserve.demo import build_demo_base

    work = Path(args.work)
    base = build_demo_base(work / "demo-qwen3", "qwen3")
    cat_dir = Path(args.catalog or work / "catalog-1m")
    Catalog.create(cat_dir, shards=args.shards).close()
    cfg = MaterializeConfig(cat_dir, base, args.count, rank=1, targets=["q_proj", "v_proj"], workers=args.workers,
                            dtype=args.dtype)
    rep = materialize(cfg)
    with Catalog.open(cat_dir, readonly=True) as cat:
        st = cat.stats()
    t0 = time.perf_counter()
    audit = run_audit(cat_dir, base, sample=256)
    audit_s = time.perf_counter() - t0
    table(f"materialize {args.count:,} rank-1 q_proj,v_proj adapters, demo base, {args.shards} shards, "
          f"{args.workers} workers, dtype {args.dtype or 'base (float32)'}", [
        ("written / already present", f"{rep.written:,} / {rep.skipped:,}"),
        ("build errors", len(rep.errors)),
        ("wall seconds (incl. final fsync)", f"{rep.seconds:.1f}"),
        ("adapters / s", f"{rep.written / rep.seconds:,.0f}"),
        ("catalog adapters / revisions", f"{st['adapters']:,} / {st['revisions']:,}"),
        ("blob bytes per adapter", f"{st['bytes'] / max(st['adapters'], 1):,.0f}"),
        ("disk bytes per adapter (LMDB pages)", f"{st['disk_bytes'] / max(st['adapters'], 1):,.0f}"),
        ("audit: shards covered", f"{audit.shards_covered}/{audit.shards}"),
        ("audit: adapters / failures / max err", f"{audit.audited} / {len(audit.failures)} / {audit.max_error:.2e}"),
        ("audit seconds", f"{audit_s:.1f}"),
    ])


def _percentiles(samples: list[float]) -> str:
    s = sorted(samples)
    return f"p50 {s[len(s) // 2] * 1e6:8.1f} us   p99 {s[int(len(s) * 0.99)] * 1e6:8.1f} us"


def bench_reads(args) -> None:
    cat_dir = Path(args.catalog or Path(args.work) / "catalog-1m")
    rng = random.Random(0)
    with Catalog.open(cat_dir, readonly=True) as cat:
        n = cat.stats()["adapters"]
        ids = [f"synth/a{rng.randrange(n):07d}" for _ in range(args.reads)]
        for a in ids[:200]:  # open every shard env first
            cat.resolve(a)
        lookup, blob = [], []
        for a in ids:
            t0 = time.perf_counter()
            rec = cat.resolve(a)
            t1 = time.perf_counter()
            cat.read_blob(rec)
            t2 = time.perf_counter()
            lookup.append(t1 - t0)
            blob.append(t2 - t1)
    table(f"random point reads over {n:,} adapters ({args.reads:,} reads, one thread)", [
        ("record lookup (resolve)", _percentiles(lookup)),
        ("blob read + xxh3 checksum", _percentiles(blob)),
    ])


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process and the processes `pids`."""
    t = os.times()
    total = t.user + t.system
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _timed_each(fn, items, pids: list[int]) -> tuple[list[float], float]:
    """(wall seconds of each call, CPU seconds per call of this process and `pids`)."""
    out, cpu = [], _cpu_s(pids)
    for item in items:
        t0 = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - t0)
    return out, (_cpu_s(pids) - cpu) / len(items)


def _containment_figures(cat, ids: list[str], batches: list[list[str]]) -> dict[str, tuple[list[float], float]]:
    """Per-call wall seconds and CPU of resolve hit, resolve miss, read_blob and a read_blobs batch."""
    for a in ids[:400]:  # every shard open (in-process env, or host started and env mapped)
        cat.resolve(a)

    def miss(a: str) -> None:
        cat.resolved.clear()
        cat.resolve(a)

    hot = ids[:64]
    records = {a: cat.resolve(a) for a in {a for b in batches for a in b} | set(ids[:2000])}
    pids = cat.host_pids() if hasattr(cat, "host_pids") else []
    return {
        "resolve hit": _timed_each(cat.resolve, [hot[i % len(hot)] for i in range(len(ids))], pids),
        "resolve miss": _timed_each(miss, ids, pids),
        "read_blob": _timed_each(lambda a: cat.read_blob(records[a]), ids[:2000], pids),
        "read_blobs (batch)": _timed_each(lambda b: cat.read_blobs([records[a] for a in b]), batches, pids),
    }


def bench_containment(args) -> None:
    """Storage containment's cost: the same reads in-process (LMDB mapped here) and through shard
    hosts (IsolatedCatalog: this process maps nothing), one thread, one run, same ids. Wall time
    per call (p50 / p99) and CPU per call, this process and its shard hosts together."""
    from loraserve.catalog.isolated import IsolatedCatalog
    from loraserve.demo import build_demo_base

    work = Path(args.work)
    cat_dir = Path(args.catalog or work / f"catalog-{args.count}")
    if not (cat_dir / "catalog.json").exists():
        base = build_demo_base(work / "demo-qwen3", "qwen3")
        Catalog.create(cat_dir, shards=args.shards).close()
        materialize(MaterializeConfig(cat_dir, base, args.count, rank=1, targets=["q_proj", "v_proj"],
                                      workers=args.workers))
    rng = random.Random(0)
    with Catalog.open(cat_dir, readonly=True) as cat:
        n, blob_bytes = cat.stats()["adapters"], cat.stats()["bytes"]
    ids = [f"synth/a{rng.randrange(n):07d}" for _ in range(args.reads)]
    batches = [[f"synth/a{rng.randrange(n):07d}" for _ in range(args.batch)] for _ in range(args.reads // args.batch)]
    rows = {}
    for name, opener in (("in-process", lambda: Catalog.open(cat_dir, readonly=True)),
                         ("shard hosts", lambda: IsolatedCatalog(cat_dir, readonly=True))):
        with opener() as cat:
            hosts = len(getattr(cat, "hosts", [])) or None
            rows[name if hosts is None else f"{name} ({hosts})"] = _containment_figures(cat, ids, batches)
    names = list(rows)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table(f"catalog reads, {n:,} adapters of {blob_bytes / max(n, 1):,.0f} blob bytes, {args.shards} shards, one "
          f"thread; wall p50 / p99 and CPU us per call; read_blobs: batches of {args.batch} random revisions; "
          f"{os.cpu_count()} CPUs, load average {load} at the end", [
        ("", *(f"{nm:>34}" for nm in names)),
        *[(op, *(f"{_p(rows[nm][op][0], 50):>9.1f} / {_p(rows[nm][op][0], 99):>8.1f} / {rows[nm][op][1] * 1e6:>8.1f}"
                 for nm in names)) for op in rows[names[0]]],
    ])


def _p(samples: list[float], q: int) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, len(s) * q // 100)] * 1e6


def _moe_tensors(layers: int, experts: int, hidden: int, inter: int, rank: int, packed: bool) -> dict:
    dims = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    out = {}
    for l in range(layers):
        for proj, (fan_in, fan_out) in dims.items():
            p = f"layers.{l}.mlp.experts"
            if packed:
                out[f"{p}.{proj}.lora_A"] = torch.full((experts, rank, fan_in), 0.01, dtype=torch.bfloat16)
                out[f"{p}.{proj}.lora_B"] = torch.full((experts, fan_out, rank), 0.01, dtype=torch.bfloat16)
            else:
                for e in range(experts):
                    out[f"{p}.{e}.{proj}.lora_A"] = torch.full((rank, fan_in), 0.01, dtype=torch.bfloat16)
                    out[f"{p}.{e}.{proj}.lora_B"] = torch.full((fan_out, rank), 0.01, dtype=torch.bfloat16)
    return out


def _pool(layers: int, experts: int, hidden: int, inter: int, rank: int, device) -> dict:
    """The engine's row pools for one slot: A_rows [R, E, in], B_rows [R, E, out] per layer and projection."""
    dims = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return {(l, p): (torch.empty(rank, experts, i, dtype=torch.bfloat16, device=device),
                     torch.empty(rank, experts, o, dtype=torch.bfloat16, device=device))
            for l in range(layers) for p, (i, o) in dims.items()}


def blob_views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy tensor views into a blob held as a uint8 tensor (the CPU cache's bytes; pinned for CUDA)."""
    from loraserve.catalog.format import read_header

    entries, _, offset = read_header(memoryview(buf.numpy()))
    return {name: buf[offset + e["data_offsets"][0]: offset + e["data_offsets"][1]].view(torch.bfloat16).view(e["shape"])
            for name, e in entries.items()}


def load_packed(buf: torch.Tensor, pool: dict) -> None:
    """One copy per (layer, projection, factor): [E, R, in] -> rows [R, E, in], [E, out, R] -> [R, E, out]."""
    t = blob_views(buf)
    for (l, proj), (a_rows, b_rows) in pool.items():
        p = f"layers.{l}.mlp.experts.{proj}"
        a_rows.copy_(t[f"{p}.lora_A"].to(a_rows.device, non_blocking=True).permute(1, 0, 2))
        b = t[f"{p}.lora_B"].to(b_rows.device, non_blocking=True).transpose(1, 2).contiguous()  # [E, R, out]
        b_rows.copy_(b.permute(1, 0, 2))  # whole rows of `out` per (r, e): cache-friendly


def load_per_expert(buf: torch.Tensor, pool: dict) -> None:
    """One copy per (layer, projection, expert, factor), as a per-expert layout forces."""
    t = blob_views(buf)
    for (l, proj), (a_rows, b_rows) in pool.items():
        for e in range(a_rows.shape[1]):
            p = f"layers.{l}.mlp.experts.{e}.{proj}"
            a_rows[:, e].copy_(t[f"{p}.lora_A"].to(a_rows.device, non_blocking=True))
            b_rows[:, e].copy_(t[f"{p}.lora_B"].to(b_rows.device, non_blocking=True).t())


def _timed(fn, *a, repeat: int = 3, device=None) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*a)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_moe(args) -> None:
    device = torch.device(args.device)
    shape = dict(layers=args.moe_layers, experts=128, hidden=2048, inter=768, rank=16)
    pin = device.type == "cuda"
    packed, per_expert = (torch.frombuffer(bytearray(save(_moe_tensors(**shape, packed=k))), dtype=torch.uint8)
                          for k in (True, False))
    packed, per_expert = (b.pin_memory() if pin else b for b in (packed, per_expert))
    pool = _pool(**shape, device=device)
    t_packed = _timed(load_packed, packed, pool, device=device)
    t_per = _timed(load_per_expert, per_expert, pool, device=device)
    table(f"MoE LoRA loading (Qwen3-30B-A3B dims: {shape['layers']} layers, E 128, H 2048, I 768, rank 16, "
          f"bf16, blob bytes in memory -> header parse + zero-copy views -> copy into the {device} row pool; best of 3)", [
        ("blob MiB (packed / per-expert)", f"{packed.numel() / 2**20:.1f} / {per_expert.numel() / 2**20:.1f}"),
        ("tensors (packed / per-expert)", f"{shape['layers'] * 6} / {shape['layers'] * 6 * 128}"),
        ("packed load s", f"{t_packed:.3f}"),
        ("per-expert load s", f"{t_per:.3f}"),
        ("speedup", f"{t_per / t_packed:.1f}x"),
    ])


QWEN3_4B = dict(hidden=2560, inter=9728, layers=36, q_out=4096, kv_out=1024, vocab=151936)


def _layer_shapes(l: int) -> dict[str, tuple[int, int]]:
    d = QWEN3_4B
    return {f"model.layers.{l}.self_attn.q_proj.weight": (d["q_out"], d["hidden"]),
            f"model.layers.{l}.self_attn.k_proj.weight": (d["kv_out"], d["hidden"]),
            f"model.layers.{l}.self_attn.v_proj.weight": (d["kv_out"], d["hidden"]),
            f"model.layers.{l}.self_attn.o_proj.weight": (d["hidden"], d["q_out"]),
            f"model.layers.{l}.mlp.gate_proj.weight": (d["inter"], d["hidden"]),
            f"model.layers.{l}.mlp.up_proj.weight": (d["inter"], d["hidden"]),
            f"model.layers.{l}.mlp.down_proj.weight": (d["hidden"], d["inter"]),
            f"model.layers.{l}.input_layernorm.weight": (d["hidden"],),
            f"model.layers.{l}.post_attention_layernorm.weight": (d["hidden"],)}


def _fsync_dir_files(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def merged_handoff(model_dir: Path) -> tuple[float, float, int]:
    """Save the full merged bf16 weights (sharded per layer, fsynced) and load them back; (save s, load s, bytes)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    d, save_s, files, weight_map = QWEN3_4B, 0.0, [], {}
    shards = [{"model.embed_tokens.weight": (d["vocab"], d["hidden"])}] + [_layer_shapes(l) for l in range(d["layers"])]
    shards.append({"model.norm.weight": (d["hidden"],), "lm_head.weight": (d["vocab"], d["hidden"])})
    for i, shapes in enumerate(shards):
        tensors = {k: torch.full(s, 0.01, dtype=torch.bfloat16) for k, s in shapes.items()}  # outside the timer
        path = model_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        t0 = time.perf_counter()
        save_file(tensors, str(path))
        _fsync_dir_files([path])
        save_s += time.perf_counter() - t0
        files.append(path)
        weight_map.update({k: path.name for k in shapes})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": d["hidden"], "intermediate_size": d["inter"], "num_hidden_layers": d["layers"],
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": d["vocab"]}))
    t0 = time.perf_counter()
    # clone: load_file maps lazily; a load must bring every byte into memory (as load_revision does)
    nbytes = sum(sum(t.clone().numel() * t.element_size() for t in load_file(str(p)).values()) for p in files)
    return save_s, time.perf_counter() - t0, nbytes


def _write_peft(peft_dir: Path, rank: int) -> None:
    """A PEFT LoRA dir on all 7 projections (the trainer's output; written outside the timer)."""
    peft_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for l in range(QWEN3_4B["layers"]):
        for name, shape in _layer_shapes(l).items():
            if len(shape) == 2:
                m = "base_model.model." + name.removesuffix(".weight")
                tensors[f"{m}.lora_A.weight"] = torch.full((rank, shape[1]), 0.01, dtype=torch.bfloat16)
                tensors[f"{m}.lora_B.weight"] = torch.full((shape[0], rank), 0.01, dtype=torch.bfloat16)
    save_file(tensors, str(peft_dir / "adapter_model.safetensors"))
    (peft_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))


def adapter_handoff(model_dir: Path, peft_dir: Path, cat_dir: Path) -> tuple[float, float, float, int]:
    """(export s, store s, load s, blob bytes): PEFT dir -> blob -> fsynced LMDB txn -> verified read -> tensors."""
    base = BaseInfo.from_dir(model_dir, fingerprint="f" * 32)  # the base's fingerprint is known to both sides
    t0 = time.perf_counter()
    blob = save_revision(export_peft(peft_dir, base, dtype="bfloat16"))
    t1 = time.perf_counter()
    with Catalog.create(cat_dir, shards=100) as cat:
        rec = cat.put_revision("bench/handoff", blob)
        t2 = time.perf_counter()
        load_revision(cat.read_blob(cat.resolve("bench/handoff")))
        t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, rec.size


def bench_handoff(args) -> None:
    import shutil

    work = Path(args.work) / "handoff"
    shutil.rmtree(work, ignore_errors=True)
    save_s, load_s, merged_bytes = merged_handoff(work / "merged")
    _write_peft(work / "peft", args.handoff_rank)
    exp_s, store_s, aload_s, blob_bytes = adapter_handoff(work / "merged", work / "peft", work / "catalog")
    merged, adapter = save_s + load_s, exp_s + store_s + aload_s
    table(f"handoff, Qwen3-4B dims (36 layers, H 2560, I 9728, V 151936), bf16, LoRA rank {args.handoff_rank} "
          "on q,k,v,o,gate,up,down", [
        ("merged checkpoint: save (fsync) + load s", f"{save_s:.2f} + {load_s:.2f} = {merged:.2f}   ({merged_bytes / 2**30:.2f} GiB)"),
        ("adapter: export + store (fsync) + load s", f"{exp_s:.2f} + {store_s:.2f} + {aload_s:.2f} = {adapter:.2f}   "
                                                     f"({blob_bytes / 2**20:.1f} MiB)"),
        ("speedup", f"{merged / adapter:.1f}x"),
    ])
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=["materialize", "reads", "moe", "handoff", "containment"])
    p.add_argument("--work", default="/tmp/loraserve-bench")
    p.add_argument("--catalog", default=None)
    p.add_argument("--count", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reads", type=int, default=20_000)
    p.add_argument("--moe-layers", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--handoff-rank", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="containment: revisions per read_blobs call")
    args = p.parse_args()
    {"materialize": bench_materialize, "reads": bench_reads, "moe": bench_moe, "handoff": bench_handoff,
     "containment": bench_containment}[args.which](args)


if __name__ == "__main__":
    main()
