"""Multi-LoRA prefill: one prefill step of `--batch` prompts over 1, 8 and 32 distinct adapters
against the same step on the base alone.

    python bench/lora_prefill.py [--model DIR] [--batch 32] [--prompt 128] [--distinct 1,8,32]
                                 [--strategies auto,padded,segments]

The adapters are rank 16 on all seven targets, synthesized into a temporary catalog by
`loraserve catalog materialize`. Prefix caching is off, so
every step computes every prompt token. Cases run interleaved, best of 3. `--strategies` runs the
LoRA cases once per plan of the torch backend named (auto = its cost model; dense, padded, gather,
segments), interleaved in one process.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import subprocess
import tempfile
import time

from loraserve.engine.config import EngineConfig
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.engine.core.build import build_engine

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def prefill_ms(eng, prompt: list[int], adapters: list[str | None], tries: int = 5) -> float:
    """ms of one step that prefills every prompt. A step that ran while adapters were paging in
    can prefill part of the batch before the clock starts (the timed step then covers the rest
    and reads too fast), so a timed step that did not schedule the whole batch is retried."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(tries):
        for i, a in enumerate(adapters):
            eng.add_request(GenerateRequest(f"p{time.monotonic_ns()}-{i}", prompt, params, a))
        while eng.scheduler.parked:  # page-ins outside the timing
            eng.step()
            time.sleep(0.001)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        whole = eng.last_batch_size == len(adapters)
        while eng.has_work():
            eng.step()
        if whole:
            return dt * 1e3
    raise RuntimeError(f"no step prefilled all {len(adapters)} prompts in {tries} tries")


def use_plans(eng, strategy: str) -> None:
    """Fresh per-step plans of the torch LoRA backend, forced to `strategy` (auto: cost model)."""
    from loraserve.kernels.torch_backend import PlanCache

    lora = eng.runner.lora
    if (lora.plans.strategy or "auto") != strategy:
        lora.plans = PlanCache(None if strategy == "auto" else strategy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--distinct", default="1,8,32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--strategies", default="auto", help="torch-backend plans to run the LoRA cases with")
    args = ap.parse_args()
    model = base_or_demo(args.model)
    distinct = [int(d) for d in args.distinct.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        cat = Path(tmp) / "cat"
        subprocess.run([sys.executable, "-m", "loraserve.cli", "catalog", "materialize", str(cat), "--model", model,
                        "--count", str(max(distinct)), "--rank", "16", "--targets", TARGETS, "--prefix", "pf/",
                        "--workers", "1"], check=True, capture_output=True)
        ids = [f"pf/{i:07d}" for i in range(max(distinct))]
        eng = build_engine(EngineConfig(model_dir=model, catalog_dir=str(cat), device=args.device,
                                        max_batch_size=args.batch, max_model_len=args.prompt + 8,
                                        max_batched_tokens=args.batch * args.prompt, prefix_caching=False,
                                        max_gpu_adapters=max(distinct), max_lora_rank=16))
        prompt = [(7 * i) % (eng.vocab_size - 6) + 3 for i in range(args.prompt)]
        strategies = tuple(args.strategies.split(","))
        cases = [("base only", [None] * args.batch, "auto")] + [
            (f"{d} adapters" + (f", {s}" if strategies != ("auto",) else ""),
             [ids[i % d] for i in range(args.batch)], s) for s in strategies for d in distinct]
        for _, adapters, _ in cases:  # warm-up, pages every adapter in
            prefill_ms(eng, prompt, adapters)
        best = {name: float("inf") for name, _, _ in cases}
        for _ in range(3):
            for name, adapters, strategy in cases:
                if strategies != ("auto",):
                    use_plans(eng, strategy)
                best[name] = min(best[name], prefill_ms(eng, prompt, adapters))
    tokens = args.batch * args.prompt
    print(f"prefill step: {args.batch} prompts x {args.prompt} tokens, rank 16, all 7 targets, device {eng.device}")
    w = max(12, *(len(name) for name, _, _ in cases))
    print(f"{'batch':>{w}} {'ms':>8} {'tok/s':>9} {'vs base':>8}")
    for name, _, _ in cases:
        print(f"{name:>{w}} {best[name]:>8.1f} {tokens / best[name] * 1e3:>9.0f} {best['base only'] / best[name]:>8.2f}")


if __name__ == "__main__":
    main()
