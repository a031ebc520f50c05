"""Perplexity of SmolLM2-135M-Instruct on a public-domain text: loraserve's engine (the Q4_1 file
served quantized, as `loraserve serve` does by default, and dequantized) beside llama.cpp's
`llama-perplexity` on the same files, chunked and scored the same way (loraserve/perplexity.py).

    bash bench/llamacpp/build.sh      # llama-perplexity (once)
    .venv/bin/python -P bench/perplexity.py [--ctx 128] [--chunks 0] [--f32-gguf FILE]

`--f32-gguf` is llama.cpp's side of the dequantized row: the same file with every tensor F32
(`bench/llamacpp/make_model.py --from-gguf` writes it as gguf/base-f32.gguf). Prints a table;
not part of `make test` (tests/model/test_perplexity.py holds the 4-chunk figures).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llamacpp_ppl(binary: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> float:
    cmd = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if chunks:
        cmd += ["--chunks", str(chunks)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        raise SystemExit(f"no PPL in llama-perplexity's output:\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=Path(os.environ.get(
        "LORASERVE_SMOLLM2", ROOT / ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    ap.add_argument("--f32-gguf", type=Path, default=ROOT / ".loraserve/llamacpp/smollm2/gguf/base-f32.gguf")
    ap.add_argument("--text", type=Path, default=ROOT / "tests/data/public_domain.txt")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=0, help="at most this many chunks (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-perplexity", type=Path,
                    default=ROOT / ".loraserve/llamacpp/build/bin/llama-perplexity")
    args = ap.parse_args()

    import torch

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine
    from loraserve.model.gguf import resolve_base
    from loraserve.perplexity import perplexity
    from loraserve.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    base = resolve_base(args.gguf)
    ids = Tokenizer.from_dir(base).encode(args.text.read_text())
    chunks = args.chunks or None
    print(f"{args.text.name}: {len(ids)} tokens, chunks of {args.ctx} (second half scored), "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.1f}")
    rows = []
    for label, quantize, lc_file in (("Q4_1 (served quantized, the default)", "auto", args.gguf),
                                     ("dequantized to f32", "none", args.f32_gguf)):
        engine = build_engine(EngineConfig(model_dir=str(base), device="cpu", compile="off",
                                           max_model_len=args.ctx * 2, max_batch_size=16, quantize=quantize))
        t0 = time.perf_counter()
        ours = perplexity(engine, ids, args.ctx, chunks)
        took = time.perf_counter() - t0
        del engine
        theirs = (llamacpp_ppl(args.llama_perplexity, lc_file, args.text, args.ctx, args.chunks, args.threads)
                  if args.llama_perplexity.is_file() and lc_file.is_file() else None)
        rows.append((label, ours, took, theirs))
    print("| weights | chunks | tokens scored | loraserve PPL | llama.cpp PPL | loraserve / llama.cpp | loraserve s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, ours, took, theirs in rows:
        ratio = f"{ours.ppl / theirs:.4f}" if theirs else "-"
        print(f"| {label} | {ours.chunks} | {ours.scored} | {ours.ppl:.4f} | "
              f"{theirs if theirs else '-'} | {ratio} | {took:.1f} |")


if __name__ == "__main__":
    main()
