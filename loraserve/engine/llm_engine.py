"""The synchronous engine core: add requests, step, collect output deltas.

`step()` is: schedule -> run the model -> sample -> post-process (stop checks, detokenize).
One thread owns an LLMEngine; `AsyncEngine` puts it behind asyncio.
"""
from __future__ import annotations

import logging
import os
import queue
import time

import torch

from ..model.config import ModelConfig
from ..model.loader import load_model, resolve_dtype
from ..tokenizer import Tokenizer
from .attention import KVCache
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .output import OutputProcessor
from .sampler import sample, token_logprobs
from .scheduler import Scheduler
from .sequence import Sequence
from .types import EngineError, GenerateRequest, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def _num_kv_blocks(cfg: EngineConfig, mc, dtype: torch.dtype) -> int:
    per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    need = -(-cfg.max_model_len // cfg.block_size)  # blocks of one full-length sequence
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
    elif cfg.kv_cache_mb is not None:
        blocks = cfg.kv_cache_mb * 2**20 // per_token // cfg.block_size
    else:  # room for every slot at full length, capped at 1 GiB
        blocks = min(cfg.max_batch_size * need, 2**30 // per_token // cfg.block_size)
    if blocks < need:
        raise ValueError(f"KV cache of {blocks} blocks cannot hold one sequence of max_model_len="
                         f"{cfg.max_model_len} ({need} blocks); raise kv_cache_mb")
    return blocks


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu":
            # tiny CPU ops lose more to thread hand-off than they gain; leave a core to the server
            torch.set_num_threads(cfg.torch_threads or max(1, (os.cpu_count() or 2) - 1))
        mc = ModelConfig.from_dir(cfg.model_dir)
        self.model_config = mc
        self.dtype = resolve_dtype(cfg.dtype, mc, self.device)
        self.model = load_model(cfg.model_dir, dtype=self.dtype, device=self.device).eval()
        self.tokenizer = Tokenizer.from_dir(cfg.model_dir)
        self.model_name = cfg.served_model_name or cfg.model_dir.rstrip("/").split("/")[-1]
        self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        blocks = _num_kv_blocks(cfg, mc, self.dtype)
        self.cache = KVCache(mc.num_layers, blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                             self.dtype, self.device)
        self.blocks = BlockManager(blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        self.adapters = None  # AdapterManager once enable_lora() ran
        self.scheduler = Scheduler(self.blocks, max_batch_size=cfg.max_batch_size,
                                   max_batched_tokens=cfg.max_batched_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.device)
        self.output = OutputProcessor(self.tokenizer, mc.eos_token_ids or self.tokenizer.eos_token_ids,
                                      self.max_model_len)
        self.default_gen = torch.Generator().manual_seed(cfg.seed)
        self.seqs: dict[str, Sequence] = {}
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # callbacks from other threads
        self.last_batch_size = 0
        self.notify = lambda: None  # wakes the owner thread when a page-in completes

    def enable_lora(self, manager, state) -> None:
        """Serve adapters: admission goes through the manager, the runner feeds the wrappers."""
        self.adapters = manager
        self.scheduler.gate = manager
        self.runner.lora = state

    # -- requests -----------------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """Stateless checks, safe to call from any thread. Raises EngineError (400)."""
        ids, p = req.prompt_token_ids, req.params
        if not ids:
            raise EngineError("prompt must not be empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise EngineError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              param="prompt")
        if len(ids) + p.max_tokens > self.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(ids) + p.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{p.max_tokens} for the completion).", param="max_tokens")
        if req.request_id in self.seqs:
            raise EngineError(f"duplicate request id {req.request_id!r}")

    def resolve_adapter(self, ref: str | None) -> tuple[str, str] | None:
        """'tenant/name[@rev]' -> the (adapter_id, revision) a request runs on; None = base only.
        Any thread (a catalog read). Raises catalog errors, or 404 without a catalog."""
        if ref is None:
            return None
        if self.adapters is None:
            raise EngineError(f"adapter {ref!r} asked for, but this server has no adapter catalog "
                              "(start it with --catalog)", status=404, code="model_not_found", param="model")
        return self.adapters.resolve(ref)

    def make_sequence(self, req: GenerateRequest, adapter_key=None) -> Sequence:
        gen = torch.Generator().manual_seed(req.params.seed) if req.params.seed is not None else None
        return Sequence(req.request_id, list(req.prompt_token_ids), req.params, req.adapter,
                        adapter_key, generator=gen, detok=self.tokenizer.detokenizer())

    def add_sequence(self, seq: Sequence) -> None:
        """Engine thread only."""
        self.seqs[seq.request_id] = seq
        if seq.adapter_key is not None and not self.adapters.is_ready(seq.adapter_key):
            self.scheduler.park(seq)
            self.adapters.fetch(seq.adapter_key, lambda err, s=seq: self._paged_in(s, err))
        else:
            self.scheduler.add(seq)

    def _paged_in(self, seq: Sequence, err: Exception | None) -> None:
        """Pager thread: seq's adapter is in the CPU cache (err None) or failed to load."""
        self.inbox.put((seq, err))
        self.notify()

    def fail_all(self, exc: Exception) -> list[RequestOutput]:
        """After an internal error: end every request with a 500 so no client hangs."""
        err = EngineError(f"internal error: {exc}", status=500, code="internal_error")
        outs = []
        for seq in list(self.seqs.values()):
            self.scheduler.remove(seq)
            outs.append(self.output.error(seq, err))
        self.seqs.clear()
        return outs

    def add_request(self, req: GenerateRequest) -> Sequence:
        """Validate, resolve the adapter and queue. Synchronous convenience (tests, bench)."""
        self.validate(req)
        seq = self.make_sequence(req, self.resolve_adapter(req.adapter))
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        return self.output.delta(seq)

    # -- stepping -----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.scheduler.parked)

    def _drain_inbox(self) -> list[RequestOutput]:
        """Adapters that finished paging in: unpark their sequences, or fail them."""
        outs = []
        while True:
            try:
                seq, err = self.inbox.get_nowait()
            except queue.Empty:
                return outs
            if seq.request_id not in self.seqs:
                continue
            if err is None:
                self.scheduler.unpark(seq)
            else:
                self.seqs.pop(seq.request_id)
                self.scheduler.remove(seq)
                seq.finish_reason = "error"
                outs.append(self.output.error(seq, err))

    def step(self) -> list[RequestOutput]:
        outs = self._drain_inbox()
        seqs, is_prefill = self.scheduler.schedule()
        self.last_batch_size = len(seqs)
        if not seqs:
            return outs
        result = self.runner.run(seqs, is_prefill)
        self.blocks.commit(seqs)
        for b, logits in result.prompt_logits.items():
            self.output.set_prompt_logprobs(seqs[b], logits)
        # sample for sequences whose tokens are all computed (not those mid-way through a chunked prefill)
        active = [i for i, s in enumerate(seqs)
                  if s.num_pending == 0 and s.params.max_tokens > len(s.output_ids)]
        if active:
            rows = result.last_logits[active]
            picked = [seqs[i] for i in active]
            tokens = sample(rows, picked, self.default_gen)
            ks = [s.params.logprobs for s in picked]
            lps = token_logprobs(rows, tokens, [k or 0 for k in ks]) if any(k is not None for k in ks) else None
            now = time.monotonic()
            for j, seq in enumerate(picked):
                seq.first_token_time = seq.first_token_time or now
                self.output.append(seq, int(tokens[j]), lps[j] if lps and ks[j] is not None else None)
        for seq in seqs:
            if seq.params.max_tokens == 0 and seq.num_pending == 0:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                self.seqs.pop(seq.request_id, None)
            delta = self.output.delta(seq)
            if delta is not None:
                outs.append(delta)
        return outs

    # -- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapters: list[str | None] | None = None) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids (tests, bench)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters or [None] * len(prompts)
        seqs = [self.add_request(GenerateRequest(f"gen-{time.monotonic_ns()}-{i}", p, sp, a))
                for i, (p, sp, a) in enumerate(zip(prompts, params, adapters))]
        while self.has_work():
            self.step()
            if not self.scheduler.has_work and self.scheduler.parked:
                time.sleep(0.001)
        return [s.output_ids for s in seqs]

    def stats(self) -> dict:
        sch = self.scheduler
        return {"running": len(sch.running), "waiting": len(sch.waiting), "parked": len(sch.parked),
                "batch_size": self.last_batch_size, "kv_usage": self.blocks.usage,
                "preemptions": sch.num_preemptions, "prefix_cache_hit_rate": self._prefix_hit_rate()}

    def _prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up, since start."""
        b = self.blocks
        return b.prefix_hit_tokens / b.prefix_query_tokens if b.prefix_query_tokens else 0.0
