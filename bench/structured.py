"""What structured output costs: the grammar's compile (once per (kind, text), cached), the API
process's parse check, the per-step mask of a constrained row in the sampler, and the engine's
decode throughput with 0, 1 and 8 of 32 sequences constrained.

    python bench/structured.py [--vocabs 259,151936] [--batch 8] [--repeats 200]
                               [--decode-seqs 32] [--decode-tokens 48] [--rounds 3]

For each vocabulary size: the demo base's byte-level tokenizer (259), or a synthetic byte-level
vocabulary of that size (random 1-8 character tokens over the byte alphabet, seeded: what the
compile and mask cost depends on is the vocabulary's size and token lengths, not its merges).
Prints: xgrammar's tokenizer info build (once per engine); per kind, the API-side parse check
(`structured.check_spec`, no tokenizer) and the engine's cold compile (`GrammarEngine.compile`
on a miss: the sequence's admission); then `sampler.sample` over [batch, V] random logits with
0, 1 and `batch` constrained rows (greedy, median us of `--repeats`), i.e. the step's sampling
cost of the mask. Then `decode`: a tiny random Qwen3 (the demo's dims) with that vocabulary on
the CPU (`LLMEngine`, greedy), `--decode-seqs` sequences of `--decode-tokens` tokens each, of
which 0, 1 or 8 follow a grammar that never completes within them (so every sequence decodes
the same number of tokens); decode tokens/s, and tokens per CPU-second of this process (which
other processes' load on a shared machine disturbs less), counted from the step where every
sequence has its first token. The three mixes run in turn, `--rounds` times, side by side on
the same machine state; the median per mix and the median of each round's ratio to its free
batch. Medians; this machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import tokenizers  # noqa: E402
import torch  # noqa: E402

from loraserve.engine.config import EngineConfig  # noqa: E402
from loraserve.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraserve.engine.core.sampler import sample  # noqa: E402
from loraserve.engine.core.sequence import Sequence  # noqa: E402
from loraserve.engine.core.structured import GrammarEngine, check_spec  # noqa: E402
from loraserve.engine.types import GenerateRequest, GrammarSpec, SamplingParams  # noqa: E402
from loraserve.model.tiny import (_bytes_to_unicode, byte_level_tokenizer, random_model,  # noqa: E402
                                  tiny_config)
from loraserve.model.writer import save_checkpoint  # noqa: E402
from loraserve.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                           "c": {"type": "array", "items": {"type": "number"}}},
          "required": ["a", "b"]}
SPECS = [GrammarSpec("json_object", ""), GrammarSpec("json_schema", json.dumps(SCHEMA)),
         GrammarSpec("regex", "[0-9]{3}-[a-z]+"), GrammarSpec("choice", json.dumps(["yes", "no"])),
         GrammarSpec("grammar", 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"')]


def tokenizer(vocab: int) -> Tokenizer:
    tok = byte_level_tokenizer()
    if vocab > tok.get_vocab_size(with_added_tokens=True):
        alphabet = list(_bytes_to_unicode().values())
        rng = random.Random(0)
        words = {"".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
                 for _ in range(vocab * 2)}
        base = {ch: i for i, ch in enumerate(alphabet)}
        for w in sorted(words):
            if len(base) >= vocab - 3:
                break
            base.setdefault(w, len(base))
        from tokenizers import decoders, models, pre_tokenizers
        tok = tokenizers.Tokenizer(models.BPE(vocab=base, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    n = tok.get_vocab_size(with_added_tokens=True)
    return Tokenizer(tok, [n - 1], None)


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def model_dir(tok: Tokenizer, vocab: int, root: Path) -> Path:
    """A random tiny Qwen3 (the demo's dims) of `vocab` logits with `tok`, written to root."""
    out = root / f"v{vocab}"
    if not (out / "config.json").is_file():
        eos = tok.eos_token_ids
        save_checkpoint(random_model(tiny_config("qwen3", vocab_size=vocab, eos_token_ids=eos)),
                        out)
        tok._tok.save(str(out / "tokenizer.json"))
    return out


def decode_tps(engine: LLMEngine, seqs: int, tokens: int, constrained: int,
               tag: str) -> tuple[float, float]:
    """(tokens/s, tokens per CPU-second of this process) of decoding `seqs` greedy sequences,
    `constrained` of them under a grammar that does not complete within `tokens` (all run to
    `tokens`): from the step where every sequence has its first token to the end."""
    # a JSON string that never closes (a bounded repetition, [a-z ]{N}, would do too, but
    # xgrammar 0.2.9's mask admits tokens there that its matcher then rejects: RESULTS.md)
    never_done = GrammarSpec("grammar", 'root ::= "{\\"text\\": \\"" body\nbody ::= [a-z ] body')
    for i in range(seqs):
        spec = never_done if i < constrained else None
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                structured=spec)
        engine.add_request(GenerateRequest(f"{tag}-{i}", [1 + i % 200, 2, 3, 4, 5, 6, 7, 8],
                                           params))
    started: set[str] = set()
    t0 = c0 = None
    counted = 0
    while engine.seqs:
        outs = engine.step()
        if t0 is not None:
            counted += sum(len(o.token_ids) for o in outs)
        started.update(o.request_id for o in outs if o.token_ids)
        if t0 is None and len(started) == seqs:
            t0, c0 = time.perf_counter(), time.process_time()
    return counted / (time.perf_counter() - t0), counted / (time.process_time() - c0)


def decode_table(tok: Tokenizer, vocab: int, args: argparse.Namespace, root: Path) -> None:
    """The three mixes in turn (a different one first each round), `--rounds` times, after one
    warm-up run of each; medians, and the median of each round's ratio to that round's free
    batch (paired: the machine's load drifts between rounds)."""
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir(tok, vocab, root)), device="cpu",
                                    dtype="float32", max_model_len=256,
                                    max_batch_size=args.decode_seqs))
    mixes = (0, 1, 8)
    for k in mixes:  # compile the grammar, warm the kernels and the allocator: a whole run each
        decode_tps(engine, args.decode_seqs, args.decode_tokens, k, f"warm-{k}")
    runs: dict[int, list[tuple[float, float]]] = {k: [] for k in mixes}
    for r in range(args.rounds):
        for k in mixes[r % 3:] + mixes[:r % 3]:  # each mix first in turn
            runs[k].append(decode_tps(engine, args.decode_seqs, args.decode_tokens, k, f"{r}-{k}"))
    print(f"| constrained of {args.decode_seqs} | decode tokens/s | tokens per CPU-second "
          f"| vs none, wall | vs none, CPU |\n|---|---|---|---|---|")
    for k in mixes:
        wall = statistics.median(w for w, _ in runs[k])
        cpu = statistics.median(c for _, c in runs[k])
        vs_wall = statistics.median(w / f[0] for (w, _), f in zip(runs[k], runs[0]))
        vs_cpu = statistics.median(c / f[1] for (_, c), f in zip(runs[k], runs[0]))
        print(f"| {k} | {wall:.0f} | {cpu:.0f} | {vs_wall:.2f} | {vs_cpu:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", default="259,151936")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--decode-seqs", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as root:
        run(args, Path(root))


def run(args: argparse.Namespace, root: Path) -> None:
    torch.set_num_threads(2)
    for vocab in (int(v) for v in args.vocabs.split(",")):
        tok = tokenizer(vocab)
        t0 = time.perf_counter()
        g = GrammarEngine(tok, vocab, tok.eos_token_ids)
        info = g.info  # built on a grammar worker: waited for here
        print(f"\nvocab {vocab}: tokenizer info {1e3 * (time.perf_counter() - t0):.1f} ms "
              f"({info.vocab_type.name})")
        print("| kind | API parse check (ms) | engine compile, cold (ms) |\n|---|---|---|")
        for spec in SPECS:
            check = median_us(lambda: check_spec(spec), 5) / 1e3
            t0 = time.perf_counter()
            g.compile(spec)
            print(f"| {spec.kind} | {check:.2f} | {1e3 * (time.perf_counter() - t0):.1f} |")
        logits = torch.randn(args.batch, vocab)
        print(f"| constrained rows of {args.batch} | sample() median (us) |\n|---|---|")
        for k in (0, 1, args.batch):
            seqs = []
            for i in range(args.batch):
                spec = SPECS[1] if i < k else None
                s = Sequence(f"r{i}", [1], SamplingParams(temperature=0, structured=spec))
                if spec is not None:
                    s.matcher = g.matcher(spec)
                    s.matcher.accept_string('{"a": 1')  # mid-object: a non-trivial mask
                seqs.append(s)
            gen = torch.Generator().manual_seed(0)
            us = median_us(lambda: sample(logits, seqs, gen), args.repeats)
            print(f"| {k} | {us:.0f} |")
        decode_table(tok, vocab, args, root)


if __name__ == "__main__":
    main()
