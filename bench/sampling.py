"""What vLLM's sampling extensions cost (issue 23), and that a batch without them costs what it
did before them. One run, old and new sampler interleaved round by round.

    python bench/sampling.py [--before REV] [--vocabs 151936,259] [--batches 1,8,32]
                             [--rounds 5] [--reps 10] [--decode-batches 8,32] [--model DIR]

1 `sample()` alone, a base-only batch (no sequence asks for an extension; half greedy, half
  temperature 0.8, seeded; no top-k/top-p, whose sort would dominate and is the same before and
  after): the sampler of git revision REV (default: the commit
  before the extensions) against this tree's, median CPU microseconds per call (CPU time of
  this process, one intra-op thread: steadier than wall time on a shared machine).
2 `sample()` with extensions: every row with repetition / presence / frequency penalties,
  four logit_bias entries, min_p and min_tokens, over a 512-token prompt and 128 output tokens
  ("all ext"); one such row among plain ones ("one ext"); against the same rows without the
  extensions ("sampled": temperature 0.8, seeded, as the extension rows).
3 the decode step of the engine (the demo base, or --model), base-only batches, greedy:
  milliseconds per step with the old sampler and with this tree's, swapped into the same engine
  and interleaved.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from _common import base_or_demo  # bench/_common.py, beside this script

import argparse
import importlib.util
import statistics
import subprocess
import time

import torch

import loraserve.engine.core.llm_engine as llm_engine
from loraserve.engine.core import sampler as new
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.types import SamplingParams

BEFORE = "924a661"  # the last commit before the extensions


def load_before(rev: str):
    """The sampler module of git revision `rev`, importable beside this tree's."""
    root = Path(__file__).resolve().parents[1]
    for path in ("loraserve/engine/core/sampler.py", "loraserve/engine/sampler.py"):  # moved
        got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
        if got.returncode == 0:
            break
    got.check_returncode()
    src = got.stdout
    spec = importlib.util.spec_from_loader("loraserve.engine._sampler_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "loraserve.engine"
    exec(compile(src, f"{rev}:sampler.py", "exec"), module.__dict__)
    return module


def base_batch(b: int, vocab: int) -> list[Sequence]:
    seqs = []
    for i in range(b):
        params = SamplingParams(temperature=0.0) if i % 2 == 0 else \
            SamplingParams(temperature=0.8, seed=i)
        s = Sequence(f"s{i}", list(range(32)), params,
                     generator=torch.Generator().manual_seed(i) if params.seed else None)
        s.output_ids = list(range(16))
        seqs.append(s)
    return seqs


def extension_seq(i: int, vocab: int) -> Sequence:
    g = torch.Generator().manual_seed(i)
    params = SamplingParams(temperature=0.8, seed=i, repetition_penalty=1.1, presence_penalty=0.5,
                            frequency_penalty=0.5, min_p=0.05, min_tokens=200, max_tokens=256,
                            logit_bias={3: 2.0, 5: -2.0, 7: 1.0, 11: -100.0})
    s = Sequence(f"x{i}", torch.randint(0, vocab, (512,), generator=g).tolist(), params,
                 generator=torch.Generator().manual_seed(i))
    s.output_ids = torch.randint(0, vocab, (128,), generator=g).tolist()
    return s


# CPU time of this process, not wall time: with one intra-op thread every op runs on this
# thread, and the shared machine's other jobs then cost it (almost) nothing
clock = time.process_time


def sampled_seq(ext: Sequence) -> Sequence:
    """`ext`'s sequence (prompt, output, temperature, seed) without its extensions."""
    p = ext.params
    s = Sequence(ext.request_id + "p", ext.prompt_ids, SamplingParams(
        temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens),
        generator=torch.Generator().manual_seed(p.seed))
    s.output_ids = ext.output_ids
    return s


def time_call(fn, reps: int) -> float:
    """Median CPU microseconds of fn() over `reps` calls (after one warm-up)."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return 1e6 * statistics.median(samples)


def section_sample(before, vocabs: list[int], batches: list[int], rounds: int, reps: int) -> None:
    print("## 1-2 sample() alone, median CPU us per call (rounds interleaved; median of rounds)")
    print(f"{'vocab':>7} {'batch':>5} {'before':>9} {'now':>9} {'now/before':>10} "
          f"{'sampled':>9} {'all ext':>9} {'one ext':>9} {'all/sampled':>11}")
    gen = torch.Generator().manual_seed(0)
    for vocab in vocabs:
        for b in batches:
            logits = torch.randn(b, vocab, generator=gen)
            plain = base_batch(b, vocab)
            every = [extension_seq(i, vocab) for i in range(b)]
            sampled = [sampled_seq(s) for s in every]
            one = [every[0]] + sampled[1:]
            res = {k: [] for k in ("before", "now", "sampled", "all", "one")}
            for _ in range(rounds):
                res["before"].append(time_call(lambda: before.sample(logits, plain, gen), reps))
                res["now"].append(time_call(lambda: new.sample(logits, plain, gen, [1]), reps))
                res["sampled"].append(time_call(lambda: new.sample(logits, sampled, gen, [1]),
                                                reps))
                res["all"].append(time_call(lambda: new.sample(logits, every, gen, [1]), reps))
                res["one"].append(time_call(lambda: new.sample(logits, one, gen, [1]), reps))
            m = {k: statistics.median(v) for k, v in res.items()}
            print(f"{vocab:>7} {b:>5} {m['before']:>9.1f} {m['now']:>9.1f} "
                  f"{m['now'] / m['before']:>10.3f} {m['sampled']:>9.1f} {m['all']:>9.1f} "
                  f"{m['one']:>9.1f} {m['all'] / m['sampled']:>11.2f}", flush=True)


def section_decode(before, model: str, batches: list[int], rounds: int) -> None:
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.types import GenerateRequest

    eng = build_engine(EngineConfig(model_dir=model, device="cpu", max_batch_size=max(batches),
                                    max_model_len=32 + 48 + 1))
    old_sample = lambda logits, seqs, gen, eos=(), writable=False: before.sample(logits, seqs, gen)  # noqa: E731

    def run(b: int) -> float:
        """ms per decode step of `b` greedy base-only sequences, 48 tokens each."""
        g = torch.Generator().manual_seed(b)
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        for i in range(b):
            prompt = torch.randint(3, eng.vocab_size - 3, (32,), generator=g).tolist()
            eng.add_request(GenerateRequest(f"d{b}-{i}-{time.monotonic_ns()}", prompt, params))
        while eng.scheduler.waiting:
            eng.step()
        steps, t0 = 0, clock()
        while eng.has_work():
            eng.step()
            steps += 1
        return 1000 * (clock() - t0) / max(steps, 1)

    print(f"## 3 decode step, base-only greedy batches, CPU ms/step (model {model}, "
          f"vocab {eng.vocab_size}; median of {rounds} interleaved rounds)")
    print(f"{'batch':>5} {'before':>9} {'now':>9} {'now/before':>10}")
    run(2)
    for b in batches:
        res = {"before": [], "now": []}
        for _ in range(rounds):
            for name, fn in (("before", old_sample), ("now", new.sample)):
                llm_engine.sample = fn
                res[name].append(run(b))
        llm_engine.sample = new.sample
        m = {k: statistics.median(v) for k, v in res.items()}
        print(f"{b:>5} {m['before']:>9.3f} {m['now']:>9.3f} {m['now'] / m['before']:>10.3f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--vocabs", default="151936,259")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--decode-batches", default="8,32")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# torch {torch.__version__}, 1 intra-op thread, before = {args.before}")
    before = load_before(args.before)
    section_sample(before, [int(v) for v in args.vocabs.split(",")],
                   [int(b) for b in args.batches.split(",")], args.rounds, args.reps)
    if args.decode_batches:
        section_decode(before, base_or_demo(args.model),
                       [int(b) for b in args.decode_batches.split(",")], args.rounds)


if __name__ == "__main__":
    main()
