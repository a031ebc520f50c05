"""One request on a quantized GGUF base: tokens/s and peak RSS, served quantized (the default:
the file's blocks repacked) against the same file dequantized to float32 (`--dequantize`).

    python bench/quant_smollm2.py [--model .venv/models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--tokens 64] [--rounds 5] [--threads 2]

Each configuration runs in a process of its own (a fresh engine, default flags but the one
named, compile off so no background compile competes), alternating: quantized, dequantized,
quantized, ... --rounds times each, so noise from the rest of the machine lands on both. A
process serves one greedy chat request of --tokens new tokens (ignore EOS) after one warm-up
request, and reports decode tokens/s (first token excluded) and its peak RSS (ru_maxrss, the
whole process: torch, tokenizer, KV cache included). Prints per configuration the median and
min-max over rounds, the GGUF file's tensor bytes, the base's resident linear bytes, and the
ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def child(model: str, quantize: str, tokens: int, threads: int) -> dict:
    """Load the engine once, time one request; the numbers as a dict."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.llm_engine import LLMEngine
    from loraserve.engine.types import SamplingParams
    from loraserve.model.gguf import resolve_base
    from loraserve.model.prepack import linear_weight_bytes

    base = resolve_base(model)
    engine = LLMEngine(EngineConfig(model_dir=str(base), device="cpu", compile="off", quantize=quantize,
                                    torch_threads=threads, max_model_len=512))
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([ids], first)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate([ids], params)[0]
    total = time.perf_counter() - t0
    return {"quantization": engine.quantization, "tok_s": (len(out) - 1) / max(total - prefill, 1e-9),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "linear_mib": linear_weight_bytes(engine.model) / 2**20, "text": tok.decode(out[:24])}


def tensor_bytes(model: str) -> int:
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(model).tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.model, args.child, args.tokens, args.threads)))
        return
    configs = {"quantized (default)": "auto", "dequantized f32 (--dequantize)": "none"}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, setting in configs.items():
            cmd = [sys.executable, "-P", __file__, "--model", args.model, "--tokens", str(args.tokens),
                   "--threads", str(args.threads), "--child", setting]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.model}: {tensor_bytes(args.model) / 2**20:.1f} MiB of GGUF tensors; one request, "
          f"{args.tokens} tokens, {args.threads} threads, {args.rounds} rounds alternating, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':32s} {'tok/s median':>12s} {'min-max':>14s} {'peak RSS MiB':>13s} {'linears MiB':>12s}")
    medians = {}
    for name, rs in runs.items():
        speeds = [r["tok_s"] for r in rs]
        medians[name] = statistics.median(speeds)
        print(f"{name:32s} {medians[name]:12.1f} {min(speeds):6.1f}-{max(speeds):<7.1f} "
              f"{statistics.median(r['peak_rss_mib'] for r in rs):13.0f} {rs[0]['linear_mib']:12.1f}"
              f"   [{rs[0]['quantization']}] {rs[0]['text']!r}")
    a, b = medians.values()
    print(f"quantized / dequantized tok/s: {a / b:.2f}x")


if __name__ == "__main__":
    main()
