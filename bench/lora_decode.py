"""Multi-LoRA decode: loraserve vs its own base-only batch and vs Hugging Face PEFT, one run.

    python bench/lora_decode.py [--model DIR] [--batch 32] [--tokens 32] [--distinct 1,8,32]
                                [--rank 16 | --rank 4,16,64] [--strategies auto,dense,...] [--no-peft]

1. Engine (in process): decode tokens/s for `--batch` requests spread over 1, 8, 32 distinct
   rank-16 adapters on every target, against the same batch on the base alone. A rank list gives
   adapter i the rank `ranks[i % len]` (mixed ranks). `--strategies` runs the LoRA cases once per
   plan of the torch backend named (auto = its cost model; dense, padded, gather, segments),
   interleaved in one process, so strategies compare under the same machine noise.
2. End to end: the same mixed batch sent over HTTP to a live loraserve server (uvicorn, streaming
   off, concurrent requests), against PEFT's mixed-adapter `generate(..., adapter_names=...)`
   on the same base, adapters and batch.
The adapters are made by PEFT and imported through the exporter, so both sides run identical
weights. Prints tables; ratios are the figures to quote (this machine is shared and noisy).
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

CPU_THREADS = torch.get_num_threads()  # before any engine sets its own count
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, n: int, ranks: list[int]) -> tuple[Path, list[str], dict[str, Path]]:
    from loraserve.catalog.base import BaseInfo
    from loraserve.catalog.importer import import_peft
    from loraserve.catalog.store import Catalog
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ids, dirs = [f"bench/a{i:03d}" for i in range(n)], {}
    info = BaseInfo.from_dir(base)
    with Catalog.create(root / "catalog", shards=8) as cat:
        for i, aid in enumerate(ids):
            torch.manual_seed(i)
            rank = ranks[i % len(ranks)]
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_TARGETS,
                                                    init_lora_weights=False))
            dirs[aid] = root / f"peft{i:03d}"
            peft.save_pretrained(dirs[aid])
            import_peft(cat, aid, dirs[aid], base, base=info)
    return root / "catalog", ids, dirs


def engine_decode(base: Path, catalog: Path, ids: list[str], batch: int, tokens: int,
                  distinct: list[int], device: str = "auto", repeats: int = 3, max_rank: int = 16,
                  strategies: tuple[str, ...] = ("auto",), compile: str = "auto"
                  ) -> list[tuple[str, float, float]]:
    """Best-of-`repeats` (tokens/s, ms/step) per case: base only, then each adapter count."""
    eng = _engine(base, catalog, batch, tokens, distinct, device, max_rank, compile)
    return _run_cases({compile: eng}, ids, batch, tokens, distinct, repeats, strategies)[compile]


def _engine(base: Path, catalog: Path, batch: int, tokens: int, distinct: list[int], device: str,
            max_rank: int, compile: str):
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.config import EngineConfig

    t0 = time.perf_counter()
    eng = build_engine(EngineConfig(model_dir=str(base), catalog_dir=str(catalog), max_batch_size=batch,
                                    device=device, max_model_len=64 + tokens,
                                    max_gpu_adapters=max(distinct), max_lora_rank=max_rank,
                                    compile=compile, compile_batch_sizes=[batch]))
    if eng.runner.graphs is not None:
        print(f"# --compile {compile}: {eng.runner.graphs.kind} graphs made in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return eng


def _run_cases(engines: dict, ids: list[str], batch: int, tokens: int, distinct: list[int],
               repeats: int, strategies: tuple[str, ...]) -> dict[str, list[tuple[str, float, float]]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from decode import measure

    for eng in engines.values():
        measure(eng, 2, 16, 4, [ids[0], None])  # warm-up
    cases = [("base only", None, "auto")] + [
        (f"{d} adapters" + (f", {s}" if strategies != ("auto",) else ""), [ids[i % d] for i in range(batch)], s)
        for s in strategies for d in distinct]
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for _ in range(repeats):  # interleaved, best of N: the machine's noise hits every case alike
        for name, adapters, strategy in cases:
            for mode, eng in engines.items():
                if strategies != ("auto",):
                    use_plans(eng, strategy)
                tps, ms = measure(eng, batch, 16, tokens, adapters)
                if tps > best.get((mode, name), (0.0, 0.0))[0]:
                    best[(mode, name)] = (tps, ms)
    return {mode: [(name, *best[(mode, name)]) for name, _, _ in cases] for mode in engines}


def compare_compile(base: Path, catalog: Path, ids: list[str], batch: int, tokens: int,
                    distinct: list[int], device: str, max_rank: int) -> None:
    """Eager and compiled engines side by side: greedy outputs first (they must be equal), then
    the interleaved timings and their ratio."""
    import shutil

    from loraserve.engine.types import GenerateRequest, SamplingParams

    copy = catalog.parent / "catalog-compiled"  # LMDB opens an environment once per process
    shutil.copytree(catalog, copy)
    engines = {"off": _engine(base, catalog, batch, tokens, distinct, device, max_rank, "off"),
               "on": _engine(base, copy, batch, tokens, distinct, device, max_rank, "on")}
    d = max(distinct)
    outs = {}
    for mode, eng in engines.items():
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        seqs = [eng.add_request(GenerateRequest(f"eq-{i}", [3 + i, 5, 7, 11 + i], params,
                                                ids[i % d] if i % 4 else None)) for i in range(batch)]
        while eng.has_work():
            eng.step()
        outs[mode] = [s.output_ids for s in seqs]
    same = sum(a == b for a, b in zip(outs["off"], outs["on"]))
    print(f"greedy outputs equal, eager vs compiled: {same}/{batch} sequences "
          f"({d} adapters and base-only mixed, {tokens} tokens)", flush=True)
    rows = _run_cases(engines, ids, batch, tokens, distinct, 3, ("auto",))
    print(f"engine decode, batch {batch}, all 7 targets, {tokens} tokens, best of 3 interleaved runs")
    print(f"{'batch':>12} {'eager tok/s':>12} {'compiled tok/s':>15} {'compiled/eager':>15}")
    for (name, e, _), (_, c, _) in zip(rows["off"], rows["on"]):
        print(f"{name:>12} {e:>12.1f} {c:>15.1f} {c / e:>14.2f}x")


def use_plans(eng, strategy: str) -> None:
    """Fresh per-step plans of the torch LoRA backend, forced to `strategy` (auto: cost model)."""
    from loraserve.kernels.torch_backend import PlanCache

    lora = eng.runner.lora
    if (lora.plans.strategy or "auto") != strategy:
        lora.plans = PlanCache(None if strategy == "auto" else strategy)


async def _http_batch(client, prompts: list[str], models: list[str], tokens: int) -> int:
    async def one(prompt: str, model: str) -> int:
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": tokens,
                                                       "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    counts = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, models)))
    return sum(counts)


async def _http_timed(url: str, prompts: list[str], models: list[str], tokens: int) -> tuple[int, float]:
    """Warm-up batch (pages every adapter in), then the timed batch. The client is built before
    the clock starts: building an httpx client (its SSL context) takes 20-50 ms on this machine,
    client-side work that any real client pays once. Every request opens its own connection
    (no keep-alive), so connection setup stays inside the timing."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # other prompts than the timed batch's, so the prefix cache cannot skip timed prefill
        await _http_batch(client, [f"Warm-up {i}: {p}" for i, p in enumerate(prompts)], models, 2)
        t0 = time.perf_counter()
        n = await _http_batch(client, prompts, models, tokens)
        return n, time.perf_counter() - t0


def http_tokens_per_s(base: Path, catalog: Path, prompts: list[str], models: list[str], tokens: int,
                      max_rank: int, port: int = 8766) -> float:
    """Output tokens/s of the mixed batch through a `loraserve serve` subprocess (HTTP included)."""
    from lora_residency import start_server

    proc = start_server(str(base), str(catalog), port, "--max-batch-size", str(len(prompts)),
                        "--max-gpu-adapters", str(len(set(models))), "--max-lora-rank", str(max_rank))
    url = f"http://127.0.0.1:{port}"
    try:
        n, dt = asyncio.run(_http_timed(url, prompts, models, tokens))
    finally:
        proc.terminate()
        proc.wait(30)
    return n / dt


def peft_tokens_per_s(base: Path, dirs: dict[str, Path], prompts: list[str], models: list[str], tokens: int) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"))
    tok.pad_token, tok.padding_side = "<|endoftext|>", "left"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    names = sorted(set(models))
    model = PeftModel.from_pretrained(model, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    best = 0.0
    for threads in sorted({1, CPU_THREADS}):  # PEFT's best thread count, to be fair
        torch.set_num_threads(threads)
        with torch.no_grad():
            model.generate(**enc, adapter_names=models, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
            t0 = time.perf_counter()
            out = model.generate(**enc, adapter_names=models, **kw)
            dt = time.perf_counter() - t0
        best = max(best, (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts) / dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--distinct", default="1,8,32")
    ap.add_argument("--rank", default="16", help="one rank, or a list cycled over the adapters")
    ap.add_argument("--strategies", default="auto", help="torch-backend plans to run the engine cases with")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off", "both"],
                    help="the engine's --compile; both: eager against compiled, outputs checked equal")
    args = ap.parse_args()
    base = Path(base_or_demo(args.model))
    distinct = [int(d) for d in args.distinct.split(",")]
    ranks = [int(r) for r in args.rank.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        catalog, ids, dirs = make_adapters(base, Path(tmp), max(distinct), ranks)
        if args.compile == "both":
            compare_compile(base, catalog, ids, args.batch, args.tokens, distinct, args.device, max(ranks))
            return
        rows = engine_decode(base, catalog, ids, args.batch, args.tokens, distinct, args.device,
                             max_rank=max(ranks), strategies=tuple(args.strategies.split(",")),
                             compile=args.compile)
        print(f"engine decode, batch {args.batch}, rank {args.rank}, all 7 targets, {args.tokens} tokens, "
              "best of 3 interleaved runs")
        w = max(12, *(len(name) for name, _, _ in rows))
        print(f"{'batch':>{w}} {'tok/s':>9} {'ms/step':>8} {'vs base':>8}")
        for name, tps, ms in rows:
            print(f"{name:>{w}} {tps:>9.1f} {ms:>8.2f} {tps / rows[0][1]:>8.2f}")
        if args.no_peft:
            return
        d = max(distinct)
        prompts = [f"Request {i}: tell me something." for i in range(args.batch)]
        models = [ids[i % d] for i in range(args.batch)]
        ours = http_tokens_per_s(base, catalog, prompts, models, args.tokens, max(ranks))
        theirs = peft_tokens_per_s(base, dirs, prompts, models, args.tokens)
        print(f"\nmixed batch of {args.batch} over {d} adapters, {args.tokens} tokens each")
        print(f"{'system':>28} {'tok/s':>9}")
        print(f"{'loraserve (HTTP, end to end)':>28} {ours:>9.1f}")
        print(f"{'PEFT generate(adapter_names)':>28} {theirs:>9.1f}   (best of 1 and all threads)")
        print(f"{'ratio':>28} {ours / theirs:>9.2f}x")


if __name__ == "__main__":
    main()
