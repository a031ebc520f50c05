"""Greedy parity on a quantized GGUF: loraserve serving the file quantized (its default) and
dequantized, against llama.cpp's server on the same quantized file and on its F32 twin.

    bash bench/llamacpp/build.sh
    .venv/bin/python -P bench/llamacpp/quant_parity.py [--prompts 8] [--tokens 64]

For each prompt of MODEL_DIR/prompts.json, 64 greedy tokens (`ignore_eos`) from each of the four,
and per pair of them the index of the first token where they differ ("=" when none). loraserve's
quantized kernels take the activations in float (model/quant.py), so its products are the
dequantized weights' to float rounding; llama.cpp's CPU kernels round the activations to 8 bits
per block of 32 first (its Q8_1 / Q8_0 dot products), so its quantized greedy text can leave its
own F32 text. Not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp_greedy(binary: Path, gguf: Path, prompts: list[str], tokens: int, threads: int) -> list[list[int]]:
    port = _free_port()
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "512",
                             "-ctk", "f32", "-ctv", "f32", "--no-cache-prompt", "-fa", "off", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return [httpx.post(f"{url}/completion", timeout=3600, json={
            "prompt": p, "n_predict": tokens, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False}).json()["tokens"] for p in prompts]
    finally:
        proc.terminate()
        proc.wait()


def loraserve_greedy(gguf: Path, prompts: list[str], tokens: int, quantize: str) -> list[list[int]]:
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import SamplingParams
    from loraserve.model.gguf import resolve_base
    from loraserve.tokenizer import Tokenizer

    base = resolve_base(gguf)
    tok = Tokenizer.from_dir(base)
    engine = build_engine(EngineConfig(model_dir=str(base), device="cpu", compile="off", max_model_len=512,
                                       max_batch_size=len(prompts), quantize=quantize))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([tok.encode(p) for p in prompts], params)


def first_difference(a: list[int], b: list[int]) -> int | str:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), "=")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=ROOT / ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--f32-gguf", type=Path, default=ROOT / ".loraserve/llamacpp/smollm2/gguf/base-f32.gguf")
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".loraserve/llamacpp/smollm2",
                    help="where prompts.json is (bench/llamacpp/make_model.py writes it)")
    ap.add_argument("--llama-server", type=Path, default=ROOT / ".loraserve/llamacpp/build/bin/llama-server")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompts = json.loads((args.model_dir / "prompts.json").read_text())[:args.prompts]
    runs = {
        "loraserve, quantized (default)": loraserve_greedy(args.gguf, prompts, args.tokens, "auto"),
        "loraserve, --dequantize": loraserve_greedy(args.gguf, prompts, args.tokens, "none"),
        "llama.cpp, quantized file": llamacpp_greedy(args.llama_server, args.gguf, prompts, args.tokens, args.threads),
        "llama.cpp, F32 file": llamacpp_greedy(args.llama_server, args.f32_gguf, prompts, args.tokens, args.threads),
    }
    names = list(runs)
    print(f"{len(prompts)} prompts x {args.tokens} greedy tokens; first differing token per prompt ('=': none)")
    print("| pair | first difference per prompt | prompts equal |")
    print("|---|---|---:|")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = [first_difference(x, y) for x, y in zip(runs[a], runs[b])]
            print(f"| {a} / {b} | {' '.join(map(str, diffs))} | {diffs.count('=')}/{len(diffs)} |")


if __name__ == "__main__":
    main()
