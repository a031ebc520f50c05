"""Where a small-batch decode step's time goes, at real shapes: the machine's memory-read
bandwidth, each weight layout's GEMM time at a few rows, and the engine's decode step.

    python bench/single_stream.py bandwidth                # GB/s of a large sum and copy
    python bench/single_stream.py layouts [--rows 1,4,32] [--dtype bfloat16] [--shapes smollm2]  # per-layout GEMM
    python bench/single_stream.py step --model DIR [--batches 1,4] [--profile]
    python bench/single_stream.py step --model DIR --variants 'packed:weight_prepack=on;plain:weight_prepack=off'
    python bench/single_stream.py ops --model DIR [--engine-args max_batch_size=1]   # ops a step dispatches
    python bench/single_stream.py split --model DIR [--engine-args dtype=bfloat16]    # GEMVs vs the rest
    python bench/single_stream.py plan --model DIR [--engine-args catalog_dir=CAT,adapter=ID]  # decode plan on/off

`layouts` times every linear of one decode step at Qwen3-0.6B shapes (28 layers: q/k/v, o,
gate/up, down; each layer its own weights, so they stream from memory as a model's do) in each
layout, interleaved, best of --reps, and prints the achieved weight-read bandwidth. `step` runs
the engine's decode step at each batch size and, with --profile, the torch profiler's ops.
`ops` counts the aten ops one batch-1 decode step dispatches (by op, and by the loraserve line
that called them): at one token a step pays per op, and a count does not move with the machine's
load the way a time does. Threads: --threads (default 2, the comparison's). Machine noise: every
figure is a best-of.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # bench/_common.py, for bench.decode

import argparse
import time

import torch
import torch.nn.functional as F

# Qwen3-0.6B: H 1024, 16 q heads / 8 kv heads of 128, intermediate 3072, 28 layers
SHAPES_06B = {"q": (1024, 2048), "k": (1024, 1024), "v": (1024, 1024), "o": (2048, 1024),
              "gate": (1024, 3072), "up": (1024, 3072), "down": (3072, 1024)}
LAYERS = 28
# SmolLM2-135M, q/k/v and gate/up fused as the engine serves them (30 layers; the tied head's
# [49152, 576] read once per step is not in the table)
SHAPES_SMOLLM2 = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
SHAPES = {"0.6b": (SHAPES_06B, 28), "smollm2": (SHAPES_SMOLLM2, 30)}


def best_of(fn, reps: int) -> float:
    """Least wall seconds of `reps` calls of fn (the machine is shared: the least is the figure)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth(reps: int, gib: float = 1.0) -> dict[str, float]:
    """Memory-read GB/s of a sum over `gib` GiB of float32, and read+write GB/s of a copy."""
    a = torch.ones(int(gib * 2**30) // 4)
    b = torch.empty_like(a)
    n = a.numel() * 4
    return {"sum (read)": n / best_of(a.sum, reps) / 1e9,
            "copy (read+write)": 2 * n / best_of(lambda: b.copy_(a), reps) / 1e9}


def layouts(rows: int, reps: int, fused: bool, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds of one step's linears (28 layers) at `rows` rows, per layout; at one row also
    loraserve's own one-row kernels (`kernels/cpu_gemv.cpp`) where this CPU has them."""
    from loraserve.kernels import cpu_gemv
    shapes = dict(SHAPES_06B)
    if fused == "smollm2":
        shapes = dict(SHAPES_SMOLLM2)
    elif fused:   # what a loader concatenating at load time would hand the step
        shapes = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
    weights = [{k: (torch.randn(o, i) / i ** 0.5).to(dtype) for k, (i, o) in shapes.items()}
               for _ in range(SHAPES["smollm2"][1] if fused == "smollm2" else LAYERS)]
    xs = {i: torch.randn(rows, i).to(dtype) for i, _ in shapes.values()}
    prepared = {
        "F.linear [out,in]": weights,
        "x @ W^T-contiguous [in,out]": [{k: w.t().contiguous() for k, w in l.items()} for l in weights],
        "W @ x^T [out,in]": weights,
    }
    from loraserve.model.prepack import can_prepack
    packable = can_prepack(torch.device("cpu"), dtype)  # float32, and bfloat16 where oneDNN has its kernels
    if packable:
        for hint in (1, 256):
            prepared[f"oneDNN packed (hint {hint})"] = [
                {k: torch.ops.mkldnn._reorder_linear_weight(w, hint) for k, w in l.items()} for l in weights]
    calls = {
        "F.linear [out,in]": lambda w, x: F.linear(x, w),
        "x @ W^T-contiguous [in,out]": lambda w, x: torch.mm(x, w),
        "W @ x^T [out,in]": lambda w, x: torch.mm(w, x.t()),
        "oneDNN packed (hint 1)": lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "oneDNN packed (hint 256)": lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    }
    if not packable:  # oneDNN's packed layout (see model.prepack)
        for name in ("oneDNN packed (hint 1)", "oneDNN packed (hint 256)"):
            del calls[name]
    if rows > 1 and cpu_gemv.reads_rows_once(dtype):  # the rows read the weight once (2-64)
        prepared["cpu_gemv [out,in]"] = weights
        calls["cpu_gemv [out,in]"] = lambda w, x: cpu_gemv.vec_linear(x, w)
    if rows == 1:
        prepared["torch.mv [out,in]"] = weights
        calls["torch.mv [out,in]"] = lambda w, x: torch.mv(w, x[0])
        if cpu_gemv.supports(dtype):
            prepared["cpu_gemv [out,in]"] = weights
            calls["cpu_gemv [out,in]"] = lambda w, x: cpu_gemv.vec_linear(x, w)
        if cpu_gemv.supports(dtype) and dtype == torch.float32:
            prepared["cpu_gemv column-major"] = [{k: w.t().contiguous().t() for k, w in l.items()}
                                                 for l in weights]
            calls["cpu_gemv column-major"] = lambda w, x: cpu_gemv.vec_linear(x, w)
    best = {name: float("inf") for name in calls}
    for _ in range(reps):       # interleaved: noise lands on every layout alike
        for name, call in calls.items():
            ws = prepared[name]
            t0 = time.perf_counter()
            for layer in ws:
                for k, w in layer.items():
                    call(w, xs[shapes[k][0]])
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def weight_bytes(fused: bool | str, dtype: torch.dtype = torch.float32) -> int:
    shapes, layers = SHAPES["smollm2"] if fused == "smollm2" else SHAPES["0.6b"]
    return layers * sum(i * o for i, o in shapes.values()) * dtype.itemsize


def step_profile(model: str, batches: list[int], tokens: int, profile: bool, extra: dict) -> None:
    """The engine's decode step at each batch size: ms/step, weight-read GB/s; with profile, the
    profiler's top ops of the steps."""
    from bench.decode import measure   # noqa: E402 (bench/ on the path)
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine
    eng = build_engine(EngineConfig(model_dir=model, max_batch_size=max(batches),
                                    max_model_len=32 + tokens + 1, prefix_caching=False, **extra))
    nbytes = sum(p.numel() * p.element_size() for n, p in eng.model.named_parameters()
                 if "embed" not in n)
    nbytes += sum(b.numel() * b.element_size() for _, b in eng.model.named_buffers())
    print(f"weights read per step: {nbytes / 1e9:.2f} GB (all but the embedding)")
    measure(eng, 1, 32, 4)
    for b in batches:
        results = [measure(eng, b, 32, tokens) for _ in range(3)]
        tps, ms = max(results)
        print(f"batch {b}: {tps:.1f} tok/s, {ms:.2f} ms/step, {nbytes / (ms / 1e3) / 1e9:.1f} GB/s")
        if profile:
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CPU]) as p:
                measure(eng, b, 32, 16)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def _engine(model: str, max_batch: int, tokens: int, fields: dict):
    """An engine for `step`; `fields` are EngineConfig fields (strings), and fuse=off builds the
    base without fused q/k/v and gate/up (CausalLM.fuse_projections), for a before/after."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine
    from loraserve.model.transformer import CausalLM
    fields = dict(fields)
    fuse = fields.pop("fuse", "on") != "off"
    ints = {"max_batch_size", "torch_threads", "max_lora_rank", "max_gpu_adapters"}
    fields = {k: int(v) if k in ints else v for k, v in fields.items()}
    fields.setdefault("max_batch_size", max_batch)
    real = CausalLM.fuse_projections
    if not fuse:
        CausalLM.fuse_projections = lambda self: 0
    try:
        return build_engine(EngineConfig(model_dir=model, max_model_len=32 + tokens + 1,
                                         prefix_caching=False, **fields))
    finally:
        CausalLM.fuse_projections = real


def step_variants(model: str, batches: list[int], tokens: int, rounds: int, variants: dict) -> None:
    """Decode ms/step of each variant (an engine each), interleaved: every round runs every batch
    size on every variant in turn, so the machine's noise lands on all alike; best of `rounds`,
    and each variant's ratio to the first. A variant's threads (torch_threads) are set before
    each of its runs (the setting is per process)."""
    from bench.decode import measure   # noqa: E402 (bench/ on the path)
    engines = {name: _engine(model, max(batches), tokens, fields) for name, fields in variants.items()}
    threads = {name: int(f.get("torch_threads", 0)) or torch.get_num_threads() for name, f in variants.items()}
    best: dict[tuple[str, int], float] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for b in batches:
            for name, eng in engines.items():
                torch.set_num_threads(threads[name])
                ms = measure(eng, b, 32, tokens if r else 4)[1]
                if r:
                    best[name, b] = min(best.get((name, b), float("inf")), ms)
    first = next(iter(engines))
    print(f"{'batch':>5} {'variant':<24} {'ms/step':>9} {'tok/s':>8} {'vs ' + first:>12}")
    for b in batches:
        for name in engines:
            ms = best[name, b]
            print(f"{b:>5} {name:<24} {ms:9.2f} {1e3 * b / ms:8.1f} {best[first, b] / ms:11.2f}x")


def step_ops(model: str, fields: dict, rows: int) -> None:
    """The aten ops of one batch-1 decode step (`LLMEngine.step`, prefill done), counted under a
    TorchDispatchMode: in all, by op, and the top `rows` (loraserve source line, op) pairs."""
    import collections
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from loraserve.engine.types import GenerateRequest, SamplingParams
    fields = dict(fields)
    adapter = fields.pop("adapter", None)  # with catalog_dir: the request's adapter
    eng = _engine(model, 1, 64, fields)
    eng.add_request(GenerateRequest("ops", list(range(5, 37)), SamplingParams(
        max_tokens=60, temperature=0.0, ignore_eos=True), adapter))
    while eng.scheduler.waiting or eng.scheduler.parked:
        eng.step()
    eng.step()
    ops, lines = collections.Counter(), collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = str(func.overloadpacket)
            ops[op] += 1
            frame = next((f for f in reversed(traceback.extract_stack(limit=12))
                          if "/loraserve/" in f.filename), None)
            if frame is not None:
                lines[f"{frame.filename.split('/loraserve/')[-1]}:{frame.lineno} {op}"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        eng.step()
    print(f"ops dispatched by one batch-1 decode step: {sum(ops.values())}")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common()))
    for where, n in lines.most_common(rows):
        print(f"{n:6} {where}")


def step_split(model: str, fields: dict, tokens: int, rounds: int) -> None:
    """Median and best ms of a batch-1 decode step, of its linears (timed inside the step) and of
    the rest, over `rounds` requests of 32 prompt tokens and `tokens` new ones."""
    import statistics

    from loraserve.engine.types import GenerateRequest, SamplingParams
    from loraserve.model import prepack, quant
    spent = [0.0]
    plain = {cls: cls.forward for cls in (prepack.VectorLinear, quant.QuantLinear)}  # float, quantized

    def timed(forward):
        def call(self, x):
            t0 = time.perf_counter()
            y = forward(self, x)
            spent[0] += time.perf_counter() - t0
            return y
        return call

    for cls, forward in plain.items():
        cls.forward = timed(forward)
    try:
        eng = _engine(model, 1, tokens, {"compile": "off", "max_batch_size": "1", **fields})
        steps, linears = [], []
        for r in range(rounds + 1):   # round 0 warms up
            eng.add_request(GenerateRequest(f"split-{r}", list(range(5, 37)), SamplingParams(
                max_tokens=tokens, temperature=0.0, ignore_eos=True)))
            while eng.scheduler.waiting or eng.scheduler.parked:
                eng.step()
            while eng.has_work():
                spent[0] = 0.0
                t0 = time.perf_counter()
                eng.step()
                if r:
                    steps.append(time.perf_counter() - t0)
                    linears.append(spent[0])
    finally:
        for cls, forward in plain.items():
            cls.forward = forward
    rest = [s - g for s, g in zip(steps, linears)]
    print(f"{len(steps)} decode steps at batch 1 ({fields or 'defaults'})")
    for name, v in (("step", steps), ("linears", linears), ("rest", rest)):
        print(f"{name:>8}: median {statistics.median(v) * 1e3:7.2f} ms, best {min(v) * 1e3:7.2f} ms")


def step_plan(model: str, fields: dict, tokens: int, rounds: int) -> None:
    """A batch-1 decode step with the layers run as a decode plan (model/decode_plan.py) whose loop
    runs in C++ (`cpu_fused.decode_layers`, the default), the same plan's loop in Python, and
    through the modules (the attention function's `qkv_decoder` taken away), one engine,
    interleaved request by request: median and best ms a step, and whether the tokens agree."""
    import statistics

    from loraserve.engine.core.attention import PagedAttention
    from loraserve.engine.types import GenerateRequest, SamplingParams
    from loraserve.model import decode_plan
    fields = dict(fields)
    adapter = fields.pop("adapter", None)  # with catalog_dir: the requests' adapter
    eng = _engine(model, 1, tokens, {"compile": "off", **fields})
    decoder = PagedAttention.qkv_decoder
    steps: dict[str, list[float]] = {"modules": [], "plan (python)": [], "plan (c++)": []}
    ids: dict[str, list[int]] = {}
    try:
        for r in range(rounds + 1):   # round 0 warms up
            for name in steps:
                PagedAttention.qkv_decoder = decoder if name != "modules" else None
                decode_plan.NATIVE_LOOP = name == "plan (c++)"
                seq = eng.add_request(GenerateRequest(f"{name}-{r}", list(range(5, 37)), SamplingParams(
                    max_tokens=tokens, temperature=0.0, ignore_eos=True), adapter))
                while eng.scheduler.waiting or eng.scheduler.parked:
                    eng.step()
                while eng.has_work():
                    t0 = time.perf_counter()
                    eng.step()
                    if r:
                        steps[name].append(time.perf_counter() - t0)
                ids.setdefault(name, seq.output_ids)
    finally:
        PagedAttention.qkv_decoder = decoder
        decode_plan.NATIVE_LOOP = True
    print(f"{len(steps['modules'])} decode steps each at batch 1 ({fields or 'defaults'}, adapter {adapter}); "
          f"tokens equal: {len({tuple(v) for v in ids.values()}) == 1}")
    for name, v in steps.items():
        print(f"{name:>14}: median {statistics.median(v) * 1e3:7.2f} ms, best {min(v) * 1e3:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["bandwidth", "layouts", "step", "ops", "split", "plan"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,4,32")
    ap.add_argument("--fused", action="store_true", help="layouts: qkv and gate_up concatenated")
    ap.add_argument("--shapes", default="0.6b", choices=list(SHAPES),
                    help="layouts: Qwen3-0.6B's linears, or SmolLM2-135M's (fused, as served)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="layouts: weight dtype")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-args", default="", help="step: EngineConfig fields, k=v,k=v")
    ap.add_argument("--variants", default=None,
                    help="step: engines side by side, 'name:k=v,k=v;name:...' (EngineConfig fields, "
                         "and fuse=off), interleaved, best of --rounds")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:   # a .gguf file runs as `loraserve serve --model FILE.gguf` runs it
        from loraserve.model.gguf import resolve_base
        args.model = str(resolve_base(args.model))
    if args.what == "bandwidth":
        for name, gbs in bandwidth(args.reps).items():
            print(f"{name:>20}: {gbs:6.1f} GB/s")
    elif args.what == "layouts":
        dtype = getattr(torch, args.dtype)
        fused = "smollm2" if args.shapes == "smollm2" else args.fused
        nbytes = weight_bytes(fused, dtype)
        print(f"{args.shapes} shapes, {nbytes / 1e9:.2f} GB of {args.dtype} linear weights, "
              f"{args.threads} threads, fused={bool(fused)}, best of {args.reps}")
        for rows in (int(r) for r in args.rows.split(",")):
            with torch.inference_mode():
                best = layouts(rows, args.reps, fused, dtype)
            for name, s in best.items():
                print(f"rows {rows:>3}  {name:<30} {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.1f} GB/s")
    elif args.what == "split":
        fields = dict(kv.split("=", 1) for kv in args.engine_args.split(",") if kv)
        step_split(args.model, fields, args.tokens, args.rounds)
    elif args.what == "plan":
        fields = dict(kv.split("=", 1) for kv in args.engine_args.split(",") if kv)
        step_plan(args.model, fields, args.tokens, args.rounds)
    elif args.what == "ops":
        fields = dict(kv.split("=", 1) for kv in args.engine_args.split(",") if kv)
        step_ops(args.model, {"compile": "off", "max_batch_size": "1", **fields}, 30)
    elif args.variants:
        variants = {}
        for spec in args.variants.split(";"):
            name, _, fields = spec.partition(":")
            variants[name] = dict(kv.split("=", 1) for kv in fields.split(",") if kv)
        step_variants(args.model, [int(b) for b in args.batches.split(",")], args.tokens, args.rounds,
                      variants)
    else:
        extra = dict(kv.split("=", 1) for kv in args.engine_args.split(",") if kv)
        step_profile(args.model, [int(b) for b in args.batches.split(",")], args.tokens,
                     args.profile, extra)


if __name__ == "__main__":
    main()
