"""What the numeric guards cost: the per-step screen on the hot path, the factor check on the cold path.

    python bench/guards.py [--model DIR] [--batches 1,8,32] [--steps 64] [--repeats 5]
                           [--shapes demo,0.6b] [--blobs 200]

1. Hot path (in process, base only): decode steps of `--batches` sequences with the engine's
   per-row screen of the step's logits (`LLMEngine._screen`: a sum per row and one host sync)
   and with it replaced by a pass-through, interleaved `--repeats` times in one process; the
   median ms per step of each and their ratio. The null KV block costs nothing per step (padding
   read slot 0 before, it reads the null slot now: the same gather).
2. Cold path: a page-in's decode of one blob (`layout.load_revision`) with the factor-gain check
   (`finite=True`, what a page-in runs now) against the same decode with only the exponent-bit
   finiteness scan it replaced, for adapters of the given shapes (`demo`: the demo base's; `0.6b`:
   Qwen3-0.6B's 28 layers, H 1024), rank 1 on q/v and rank 16 on every target; median us.
Prints tables; ratios are the figures to quote (this machine is shared and noisy).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import statistics
import time

import torch

SHAPES = {  # name -> (layers, hidden, q out, kv out, intermediate)
    "demo": (2, 64, 64, 32, 128),
    "0.6b": (28, 1024, 2048, 1024, 3072),
}


def hot_path(model: str, batches: list[int], steps: int, repeats: int) -> None:
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.types import GenerateRequest, SamplingParams

    eng = build_engine(EngineConfig(model_dir=model, device="cpu", dtype="float32", max_model_len=steps + 32,
                                    max_batch_size=max(batches)))
    screen = eng._screen
    print("\n== hot path: decode step, base only, per-row logits screen on vs off ==")
    print(f"{'batch':>6} {'off ms/step':>12} {'on ms/step':>12} {'on/off':>8}")
    for batch in batches:
        times = {"on": [], "off": []}
        for r in range(repeats):
            for mode in ("off", "on") if r % 2 else ("on", "off"):
                eng._screen = screen if mode == "on" else (lambda seqs, result, outs: (seqs, result))
                for i in range(batch):
                    eng.add_request(GenerateRequest(f"{mode}{r}-{i}", [3 + i, 5, 7, 11], SamplingParams(
                        max_tokens=steps, temperature=0.0, ignore_eos=True)))
                eng.step()  # the prefill
                start = time.perf_counter()
                n = 0
                while eng.has_work():
                    eng.step()
                    n += 1
                times[mode].append((time.perf_counter() - start) / max(n, 1) * 1e3)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"{batch:>6} {off:>12.3f} {on:>12.3f} {on / off:>8.3f}")
    eng._screen = screen


def screen_micro(batches: list[int], repeats: int = 50) -> None:
    """The screen's own cost at a real vocabulary (Qwen3: 151,936, hidden 1,024), against the
    one op every step has that scales the same way: the lm_head matmul that makes the logits."""
    vocab, hidden = 151_936, 1024
    weight = torch.randn(vocab, hidden) * 0.02
    print("\n== the screen at Qwen3-0.6B's vocabulary: logits sum + isfinite, against the lm_head matmul ==")
    print(f"{'batch':>6} {'lm_head us':>11} {'screen us':>10} {'screen/lm_head':>15}")
    for batch in batches:
        h = torch.randn(batch, hidden)
        logits = h @ weight.t()
        def timed(fn):
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - start) * 1e6)
            return statistics.median(runs)
        mm = timed(lambda: h @ weight.t())
        sc = timed(lambda: bool(torch.isfinite(logits.sum(dim=-1)).all()))
        print(f"{batch:>6} {mm:>11.1f} {sc:>10.1f} {sc / mm:>15.4f}")


def _blob(shape: str, rank: int, kinds: list[str]) -> bytes:
    from loraserve.catalog.layout import AdapterWeights, save_revision
    from loraserve.catalog.targets import tensor_names

    layers, h, q, kv, inter = SHAPES[shape]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for kind in kinds:
            a_name, b_name = tensor_names(kind, layer)
            d_in, d_out = dims[kind]
            tensors[a_name] = torch.randn(rank, d_in, generator=gen) * 0.02
            tensors[b_name] = torch.randn(d_out, rank, generator=gen) * 0.02
    return save_revision(AdapterWeights("fp", rank, sorted(kinds), torch.float32, tensors))


def cold_path(shapes: list[str], blobs: int) -> None:
    from loraserve.catalog import layout

    cases = [("r1 q,v", 1, ["q_proj", "v_proj"]),
             ("r16 all", 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])]
    print("\n== cold path: one page-in decode, factor-gain check vs the finiteness scan it replaced ==")
    print(f"{'shape':>6} {'adapter':>9} {'KiB':>8} {'scan us':>9} {'gain us':>9} {'gain/scan':>10}")
    for shape in shapes:
        for label, rank, kinds in cases:
            blob = _blob(shape, rank, kinds)
            bufs = [bytearray(blob) for _ in range(2 * blobs)]

            def scan(buf):  # the page-in's check before: decode, then the exponent bits
                weights = layout.load_revision(buf)
                entries, _, start = layout.read_header(buf, "b")
                assert layout._all_finite(buf, start, "float32")
                return weights

            def gain(buf):
                return layout.load_revision(buf, finite=True, compute_dtype="float32")

            timed = {"scan": [], "gain": []}
            for i, buf in enumerate(bufs):
                fn = (scan, gain)[i % 2]
                start = time.perf_counter()
                fn(buf)
                timed[fn.__name__].append((time.perf_counter() - start) * 1e6)
            s, g = statistics.median(timed["scan"]), statistics.median(timed["gain"])
            print(f"{shape:>6} {label:>9} {len(blob) / 1024:>8.1f} {s:>9.1f} {g:>9.1f} {g / s:>10.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default="demo,0.6b")
    p.add_argument("--blobs", type=int, default=200)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    cold_path(args.shapes.split(","), args.blobs)
    screen_micro([int(b) for b in args.batches.split(",")])
    hot_path(base_or_demo(args.model), [int(b) for b in args.batches.split(",")], args.steps, args.repeats)


if __name__ == "__main__":
    main()
