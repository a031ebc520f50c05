"""Which kernel multiplies a quantized base's linears, measured at decode and prefill shapes.

    python bench/quant_kernels.py [--rows 1 4 16 64] [--reps 15] [--threads 2] [--inductor]
                                  [--streams 2 4 8] [--ahead 0 1024 8192] [--only int4-g64 ...]

For each weight shape of SmolLM2-135M and Qwen3-0.6B (in -> out) and each row count, every
candidate that can hold the scheme: float32 (the reference: `cpu_gemv`'s one-row kernel, or
`F.linear` for several rows), torch's `_weight_int8pack_mm` (int8 per channel; bfloat16
activations, it is 60x slower on float32 ones), `_weight_int4pack_mm_for_cpu` (int4, group 64),
the project's kernels (`kernels/cpu_quant`, int8 per channel, int4 g32/g64/g128: the served
table kernel and the float kernel it replaced, both on float32 activations, and the VNNI variant
with activations rounded to int8; --streams/--ahead add table-kernel variants),
"dequantize, then F.linear" (the prefill path), and with --inductor torch.compile's fused
dequantize + matmul (slow to compile; int4 g64). Each candidate cycles through enough copies of
its weights to outgrow the last-level cache, as a model's layers do, so weights stream from
memory. Prints per call: us (the fastest single call over --reps interleaved rounds), GB/s of the candidate's own weight bytes
(codes + scales + mins), time relative to float32, and for the table kernels time relative to
the old float kernel of the same scheme ("x old", interleaved in the same rounds). The last
tables are the winner per scheme and row count, which `loraserve.model.quant.KERNELS` records,
and the table kernels' gain over the old one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from loraserve.kernels import cpu_gemv, cpu_quant
from loraserve.model.quant import QuantLinear, Scheme, quantize_weight

SHAPES = {"smollm2 qkv": (576, 960), "smollm2 gate_up": (576, 3072), "smollm2 down": (1536, 576),
          "qwen3 qkv": (1024, 4096), "qwen3 down": (3072, 1024), "qwen3 gate_up": (1024, 6144)}
SLOW = ("dequantize", "int4pack", "inductor")  # their time is not the weight's reading
STREAM_BYTES = 96 * 2**20  # copies of each candidate's weights: past a 32 MiB LLC
OLD = "ours float-v1 (f32 x)"  # the float-activation kernel served before the table kernel
NEW = "ours table (f32 x)"  # the served kernel (cpu_quant.quant_linear)
SERVED = (4, 8192)  # its streams and prefetch distance (cpu_quant.cpp)


def copies_for(nbytes: int) -> int:
    return max(2, -(-STREAM_BYTES // max(nbytes, 1)))


def candidates(k: int, n: int, inductor: bool, variants: list[tuple[int, int]]) -> dict:
    """name -> (scheme or None, make() -> (state, nbytes), call(state, x)). `variants`: (streams,
    prefetch bytes) of the table kernel to measure beside the served one."""
    w = torch.randn(n, k) / k ** 0.5
    out: dict = {}
    one = lambda x, ww: cpu_gemv.vec_linear(x, ww) if x.shape[0] == 1 and cpu_gemv.supports(torch.float32) \
        else F.linear(x, ww)  # noqa: E731
    out["f32"] = ("f32", lambda: (w.clone(), w.numel() * 4), lambda s, x: one(x, s))

    def int8pack():
        q = torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
        return (q, w.abs().amax(1).div(127).bfloat16()), q.numel() + 2 * n
    out["int8 torch int8pack_mm (bf16 x)"] = (
        "int8", int8pack, lambda s, x: torch._weight_int8pack_mm(x.bfloat16(), s[0], s[1]))

    def int4pack():
        p = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
        return (p, torch.randn(k // 64, n, 2)), p.numel() + k // 64 * n * 8
    out["int4-g64 torch int4pack_mm"] = (
        "int4-g64", int4pack, lambda s, x: torch._weight_int4pack_mm_for_cpu(x, s[0], 64, s[1]))

    for scheme in (Scheme(8, 0), Scheme(4, 32), Scheme(4, 64), Scheme(4, 128)):
        def make(scheme=scheme):
            codes, scales, mins, group = quantize_weight(w, scheme)
            layer = QuantLinear(codes, scales, mins, scheme.bits, group, k)
            return layer, codes.numel() + 4 * scales.numel()
        if cpu_quant.available():
            out[f"{scheme.name} {OLD}"] = (scheme.name, make, lambda s, x: cpu_quant.quant_linear_kernel(
                x, s.codes, s.scales, s.mins, s.bits, s.group, "float-v1"))
            for streams, ahead in variants:
                name = NEW if (streams, ahead) == SERVED else f"ours table s{streams} ahead {ahead} (f32 x)"
                out[f"{scheme.name} {name}"] = (
                    scheme.name, make, lambda s, x, streams=streams, ahead=ahead: cpu_quant.quant_linear_kernel(
                        x, s.codes, s.scales, s.mins, s.bits, s.group, "table", streams, ahead))
            out[f"{scheme.name} ours (vnni, int8 x)"] = (scheme.name, make, lambda s, x: cpu_quant.quant_linear(
                x, s.codes, s.scales, s.mins, s.bits, s.group, True))
        out[f"{scheme.name} dequantize + F.linear"] = (
            scheme.name, make, lambda s, x: F.linear(x, s.dequantized()))
    if inductor:
        fused = torch.compile(_torch_dequant_linear, dynamic=False)
        out["int4-g64 inductor dequant+matmul"] = (
            "int4-g64", out["int4-g64 dequantize + F.linear"][1],
            lambda s, x: fused(x, s.codes, s.scales, s.mins, s.group))
    return out


def _torch_dequant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          group: int) -> torch.Tensor:
    """int4 dequantize + matmul in plain torch ops, for inductor to fuse."""
    n, k = codes.shape[0], x.shape[1]
    packed = codes.view(n, k // 64, 1, 32)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=2).view(n, k // group, group).float()
    w = q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return x @ w.view(n, k).t()


def _copy(state):
    """Another copy of a candidate's weights (at other addresses, as another layer's are)."""
    if isinstance(state, QuantLinear):
        return QuantLinear(state.codes.clone(), state.scales.clone(), state.mins.clone(), state.bits,
                           state.group, state.in_features)
    if isinstance(state, tuple):
        return tuple(t.clone() for t in state)
    return state.clone()


def measure_all(cands: dict, k: int, rows: int, reps: int) -> dict[str, tuple[float, int]]:
    """name -> (fastest single call in us, bytes one call reads). Every candidate cycles through
    copies of its weights that outgrow the last-level cache (one set per make function, shared by
    the candidates that read the same layout); each round times each candidate's calls one by
    one, interleaved with the others', and the fastest call is the one the rest of a busy machine
    disturbed least. Compute-bound candidates (SLOW) make a few calls a round, not a full cycle."""
    x = torch.randn(rows, k)
    sets: dict[int, tuple[list, int]] = {}
    for _, make, _ in cands.values():
        if id(make) not in sets:
            state, nbytes = make()
            sets[id(make)] = ([state] + [_copy(state) for _ in range(copies_for(nbytes) - 1)], nbytes)
    best = {name: float("inf") for name in cands}
    for rep in range(reps):
        for name, (_, make, call) in cands.items():
            states, _ = sets[id(make)]
            count = 4 if any(w in name for w in SLOW) else len(states)
            for i in range(count):
                s = states[(rep * count + i) % len(states)]
                t0 = time.perf_counter()
                call(s, x)
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e6)
    return {name: (best[name], sets[id(cands[name][1])][1]) for name in cands}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--streams", type=int, nargs="*", default=[], help="table kernel variants: output rows read at once")
    ap.add_argument("--ahead", type=int, nargs="*", default=[SERVED[1]], help="... and prefetch distances (bytes)")
    ap.add_argument("--only", nargs="*", default=[], help="measure only candidates whose name holds one of these")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, vnni kernel: {cpu_quant.available()}")
    best: dict[tuple[str, int], list[tuple[float, str]]] = {}
    gains: dict[tuple[str, int, str], list[float]] = {}  # (scheme, rows, table kernel) -> old time / its time
    variants = [SERVED] + [(s, a) for s in args.streams for a in args.ahead if (s, a) != SERVED]
    for shape in args.shapes:
        k, n = SHAPES[shape]
        cands = candidates(k, n, args.inductor, variants)
        for rows in args.rows:
            print(f"\n{shape} [{n}x{k}], {rows} row(s)\n{'candidate':44s} {'us':>9s} {'GB/s':>7s} {'x f32':>7s} {'x old':>7s}")
            chosen = {name: c for name, c in cands.items()
                      if not (rows > 16 and ("int4pack" in name or "inductor" in name))
                      and (name == "f32" or not args.only or any(word in name for word in args.only))}
            results = measure_all(chosen, k, rows, args.reps)
            ref = results["f32"][0]
            for name, (us, nbytes) in results.items():
                scheme = chosen[name][0]
                old = results.get(f"{scheme} {OLD}", (0.0, 0))[0]
                vs_old = f"{old / us:7.2f}" if "table" in name and old else ""
                print(f"{name:44s} {us:9.1f} {nbytes / us / 1e3:7.1f} {ref / us:7.2f} {vs_old}")
                if scheme != "f32":
                    kind = "int8" if scheme.startswith("int8") else "int4"
                    best.setdefault((kind, rows), []).append((us / ref, name))
                if vs_old:
                    gains.setdefault((name.split()[0], rows, name.split(" ", 1)[1]), []).append(old / us)
    print("\nwinner per scheme and rows (geometric mean over shapes of time / f32 time)")
    for (kind, rows) in sorted(best):
        by_name: dict[str, list[float]] = {}
        for ratio, name in best[(kind, rows)]:
            by_name.setdefault(name, []).append(ratio)
        means = {name: statistics.geometric_mean(r) for name, r in by_name.items()}
        name = min(means, key=means.get)
        print(f"{kind} rows={rows:3d}: {name:40s} {1 / means[name]:.2f}x f32")
    print(f"\ntable kernels against {OLD} (geometric mean over shapes of old time / its time)")
    for (scheme, rows, name), ratios in sorted(gains.items()):
        print(f"{scheme:12s} rows={rows:3d} {name:40s} {statistics.geometric_mean(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
