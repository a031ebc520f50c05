"""Structured output: a sequence's tokens follow a grammar (JSON, a JSON schema, a regex, a
choice of strings, an EBNF grammar), run by xgrammar on the CPU.

`GrammarSpec` (kind, text) is what a request carries (`SamplingParams.structured`, a NamedTuple
so that it travels on the engine-core wire as a two-item array). `check_spec` validates one
without a tokenizer (the API process, before the request is queued: a 400 naming `param`); it
and the grammar text it reads live in `engine.structured`, which the server imports too.
`GrammarEngine` is one per engine, built with it: the xgrammar tokenizer info (from the model's
`tokenizers.Tokenizer` vocabulary) and the compiler are built on a worker thread at once, so the
first constrained request does not pay for them, and a bounded LRU holds compiled grammars by
(kind, text). Compiling runs on the same workers (`prepare`: a future; one compile per key at a
time, however many requests ask for it): the engine core admits a request whose grammar is not
compiled yet once its future is done (`engine_core.EngineCore._add`), so the step never waits for a
compile. `matcher(spec)` waits for it at most `compile_timeout_s`: a grammar that takes longer
(a pathological schema or regex) is a 400 naming the request's field, as one that does not
compile is.

In the step (`sampler.adjust_logits`), a constrained row's logits are masked with its matcher's
allowed-token bitmask before sampling (greedy and random alike); `output.TokenOutputs.append`
advances the matcher with the accepted token and ends the sequence ("stop") once the matcher
is terminated (the grammar was complete and a stop token was accepted). Logprobs stay the
model's raw distribution.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from loraserve.catalog.lru import BoundedLRU

from ..structured import (GRAMMAR_CACHE_SIZE, JSON_OBJECT_SCHEMA, MAX_GRAMMAR_CHARS,  # noqa: F401
                          _compile_error, _grammar_of, _xgr, check_spec, json_safe_strings,
                          json_schema_ebnf, rename_rule)
from ..types import EngineError, GrammarSpec

__all__ = ["GrammarEngine", "GrammarSpec", "check_spec", "json_safe_strings", "json_schema_ebnf",
           "mask_rows", "rename_rule", "tokenizer_info"]
COMPILE_TIMEOUT_S = 10.0  # a grammar that does not compile against the vocabulary in this: 400


def _vocab_type(tokenizer_json: str, vocab: list[str]):
    """xgrammar's VocabType the way its from_huggingface decides it (tokenizer.json's decoder)."""
    xgr = _xgr()
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        return meta["vocab_type"], bool(meta.get("add_prefix_space", False))
    except Exception:
        if any(t.startswith("<0x") and t.endswith(">") and len(t) == 6 for t in vocab):
            return xgr.VocabType.BYTE_FALLBACK, True
        return xgr.VocabType.RAW, False


def tokenizer_info(tok: Any, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar TokenizerInfo from a loraserve Tokenizer (its `tokenizers.Tokenizer` vocabulary,
    id -> token string) for a model of `vocab_size` logits; stop tokens: the model's EOS ids."""
    xgr = _xgr()
    raw = tok._tok
    n = raw.get_vocab_size(with_added_tokens=True)
    encoded = [""] * n
    for text, i in raw.get_vocab(with_added_tokens=True).items():
        if 0 <= i < n:
            encoded[i] = text
    vocab_type, prefix_space = _vocab_type(raw.to_str(), encoded)
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=max(vocab_size, n),
                             stop_token_ids=list(stop_token_ids), add_prefix_space=prefix_space)


class GrammarEngine:
    """Compiles and caches grammars for one tokenizer on its own worker threads; hands out
    per-sequence matchers. Any thread may call it."""

    def __init__(self, tok: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.cache: BoundedLRU[tuple[str, str], Any] = BoundedLRU(cache_size)
        self.compile_seconds = 0.0  # total spent compiling (misses), for the bench
        self.compiles = 0
        self._lock = threading.Lock()  # guards _pending (the cache has its own)
        self._pending: dict[tuple[str, str], Future] = {}
        # two workers: the tokenizer info first, then compiles; a compile that runs long holds
        # one of them, and the requests waiting on it time out
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="loraserve-grammar")
        self._compiler = self._pool.submit(self._new_compiler, tok, vocab_size, stop_token_ids)
        self._ready_at = math.inf  # when the tokenizer info was built (monotonic)
        self._compiler.add_done_callback(self._ready)

    def _ready(self, _: Future) -> None:
        self._ready_at = time.monotonic()

    def when_ready(self, fn: Callable[[], None]) -> None:
        """Call fn once the tokenizer info is built (at once if it is): where a compile's time
        bound starts. The bound is on compiling a grammar; the engine's one-time tokenizer setup
        does not count against the first requests (on a busy host it alone can outlast it)."""
        self._compiler.add_done_callback(lambda _: fn())

    def late(self, since: float) -> bool:
        """Whether a request waiting since `since` (monotonic) is past the compile bound,
        counted from when_ready."""
        return time.monotonic() - max(since, self._ready_at) > self.compile_timeout_s

    @staticmethod
    def _new_compiler(tok: Any, vocab_size: int, stop_token_ids: list[int]) -> tuple[Any, Any]:
        """(TokenizerInfo, GrammarCompiler). xgrammar's own cache is off: ours is bounded by
        count and keyed by (kind, text)."""
        info = tokenizer_info(tok, vocab_size, stop_token_ids)
        return info, _xgr().GrammarCompiler(info, max_threads=2, cache_enabled=False)

    @property
    def info(self):
        """The xgrammar TokenizerInfo (waits for the worker that builds it)."""
        return self._compiler.result()[0]

    def prepare(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of `spec`, as a future: done at once on a cache hit, else
        compiled on a worker (one compile per key, shared by every request that asks)."""
        compiled = self.cache.get(spec.key)
        if compiled is not None:
            done: Future = Future()
            done.set_result(compiled)
            return done
        with self._lock:
            fut = self._pending.get(spec.key)
            if fut is None:
                fut = self._pool.submit(self._compile, spec)
                self._pending[spec.key] = fut
        return fut

    def _compile(self, spec: GrammarSpec):
        """Worker: compile, cache, and leave the pending table (whatever the outcome)."""
        try:
            compiler = self._compiler.result()[1]
            t0 = time.perf_counter()
            try:
                compiled = compiler.compile_grammar(_grammar_of(spec))
            except Exception as exc:  # xgrammar: RuntimeError / ValueError with its parser's text
                raise _compile_error(spec, exc) from None
            self.compile_seconds += time.perf_counter() - t0
            self.compiles += 1
            self.cache.put(spec.key, compiled)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(spec.key, None)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar, waiting at most `compile_timeout_s`; EngineError (400 naming
        the field) for a grammar that does not compile, or not in time."""
        try:
            return self.prepare(spec).result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise self.timeout_error(spec) from None

    def timeout_error(self, spec: GrammarSpec) -> EngineError:
        return EngineError(f"{spec.param}: the {spec.kind.replace('_', ' ')} did not compile "
                           f"within {self.compile_timeout_s:g} s", param=spec.param)

    def matcher(self, spec: GrammarSpec):
        return _xgr().GrammarMatcher(self.compile(spec))

    def close(self) -> None:
        """Stop the workers (a compile under way finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """In place: each row rows[j] of logits [B, V] keeps only the tokens matchers[j] allows
    (the others at -inf), one row at a time: its bitmask ([1, V/32] int32) filled and applied
    to the row where it is (a view). No copy of the constrained rows out of the batch and back,
    and no [k, V/32] fill, whose intra-op threads cost more than the mask itself on a busy CPU
    (bench/RESULTS.md)."""
    xgr = _xgr()
    vocab = logits.shape[-1]
    for row, m in zip(rows, matchers):
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits[row], bitmask[0].to(logits.device),
                                        vocab_size=vocab)
