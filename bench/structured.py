"""What structured output costs: the grammar's compile (once per (kind, text), cached), the API
process's parse check, and the per-step mask of a constrained row in the sampler.

    python bench/structured.py [--vocabs 259,151936] [--batch 8] [--repeats 200]

For each vocabulary size: the demo base's byte-level tokenizer (259), or a synthetic byte-level
vocabulary of that size (random 1-8 character tokens over the byte alphabet, seeded: what the
compile and mask cost depends on is the vocabulary's size and token lengths, not its merges).
Prints: xgrammar's tokenizer info build (once per engine); per kind, the API-side parse check
(`structured.check_spec`, no tokenizer) and the engine's cold compile (`GrammarEngine.compile`
on a miss: the sequence's admission); then `sampler.sample` over [batch, V] random logits with
0, 1 and `batch` constrained rows (greedy, median us of `--repeats`), i.e. the step's sampling
cost of the mask. Medians; this machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import tokenizers  # noqa: E402
import torch  # noqa: E402

from loraserve.engine.core.sampler import sample  # noqa: E402
from loraserve.engine.core.sequence import Sequence  # noqa: E402
from loraserve.engine.core.structured import GrammarEngine, check_spec  # noqa: E402
from loraserve.engine.types import GrammarSpec, SamplingParams  # noqa: E402
from loraserve.model.tiny import _bytes_to_unicode, byte_level_tokenizer  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", default="259,151936")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(2)
    for vocab in (int(v) for v in args.vocabs.split(",")):
        tok = tokenizer(vocab)
        t0 = time.perf_counter()
        g = GrammarEngine(tok, vocab, tok.eos_token_ids)
        print(f"\nvocab {vocab}: tokenizer info {1e3 * (time.perf_counter() - t0):.1f} ms "
              f"({g.info.vocab_type.name})")
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


if __name__ == "__main__":
    main()
