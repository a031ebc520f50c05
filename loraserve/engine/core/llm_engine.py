"""The synchronous engine core: add requests, step, collect output deltas.

`step()` is the pipeline: drain page-ins -> schedule -> run the model -> sample -> post-process,
each a named stage below. One thread owns an LLMEngine (`AsyncEngine` puts it behind asyncio):
it is the only writer of the scheduler, the KV block books and the adapter pool, and it
publishes an immutable `EngineSnapshot` for every other thread to read.
"""
from __future__ import annotations

import logging
import queue
import time

import torch

from ...adapters.manager import RevisionQuarantined
from ...kernels import cpu_fused
from ...model.config import ModelConfig
from ...model import quant_load
from ...model.loader import load_model, resolve_dtype
from ...model.prepack import outgrows_last_level_cache, prepack_linears, usable_cpus, vector_linears, weight_layout
from ...tokenizer import Tokenizer
from .attention import KVCache
from .block_manager import BlockManager
from ..config import EngineConfig, prefill_tokens
from ..directory import EVERYONE, AdapterDirectory
from .model_runner import ModelRunner, StepResult
from .output import TokenOutputs
from .sampler import sample, token_logprobs
from .structured import GrammarEngine
from .scheduler import Scheduler
from .sequence import Sequence
from ..snapshot import CPU_RESIDENT_MAX, DETAIL_EVERY_S, DETAIL_FIELDS, PUBLISH_EVERY_S, EngineSnapshot
from ..types import EngineError, GenerateRequest, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
AdapterKey = tuple[str, str]
# how long a step waits for the page-ins asked for since the last one to be read, so that their
# requests join this step's batch rather than the next (bench/RESULTS.md, issue 29: on the busy
# 2-core box 21-40% of such waits ended early; 0 turns the wait off). A step that can decode
# instead does not wait: it decodes first, and the reads land meanwhile (`_drain_page_ins`).
PAGE_IN_GRACE_S = 0.005
# `warm_up`'s request: greedy decode steps after its prefill (the first one and a steady one)
WARM_UP_DECODE_STEPS = 2


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


def default_torch_threads(big_base: bool, cpus: int) -> int:
    """Intra-op threads without --torch-threads: every core for a base whose weights outgrow the
    last-level cache (its GEMMs scale: an H 512 base's batches ran 1.6x faster on 2 threads than
    on 1), else all but one: tiny ops lose more to thread hand-off than they gain (the demo base's
    1-token requests ran 2.5x slower on 2), and the API server keeps a core."""
    return cpus if big_base else max(1, cpus - 1)


def _plain_greedy(params: SamplingParams) -> bool:
    """Whether `sample` picks this request's token as the argmax of the raw logits and nothing
    else is read from them: temperature 0, no logits adjusted (penalties, bias, min_tokens,
    min_p, a grammar), no logprobs."""
    return params.temperature == 0 and not params.adjusts_logits and params.logprobs is None


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        mc = ModelConfig.from_dir(cfg.model_dir)
        self.model_config = mc
        self.dtype = resolve_dtype(cfg.dtype, mc, self.device)
        self.model = load_model(cfg.model_dir, dtype=self.dtype, device=self.device).eval()
        # weight-only quantized linears (model.quant_load), before fusing stacks them; its name
        # goes into the served base's fingerprint (engine.core.build)
        self.quantization = quant_load.apply(self.model, cfg.model_dir, cfg.quantize, cfg.quantize_group, cfg.dtype)
        self.model.fuse_projections()  # q/k/v and gate/up: one GEMM each, before packing and LoRA
        if self.device.type == "cpu":  # threads and weight layout follow the base's size
            big = outgrows_last_level_cache(self.model)
            torch.set_num_threads(cfg.torch_threads or default_torch_threads(big, usable_cpus()))
            layout = weight_layout(cfg.weight_prepack, self.model, self.device, self.dtype,
                                   cfg.max_batch_size)
            if layout == "packed":
                prepack_linears(self.model, batch_hint=cfg.max_batch_size)  # before LoRA wraps them
            elif big:
                vector_linears(self.model)  # one-row steps as matrix-vector products
            # the fused decode ops' library, built (~16 s, once per machine) or loaded here at
            # start-up, not inside the first step, which the stall watch times
            cpu_fused.available()
            log.info("CPU engine: %d intra-op threads, base weights %s", torch.get_num_threads(),
                     "packed for oneDNN" if layout == "packed" else "plain")
        self.tokenizer = Tokenizer.from_dir(cfg.model_dir)
        self.model_name = cfg.model_name
        self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        blocks = _num_kv_blocks(cfg, mc, self.dtype)
        # one block more than the block manager hands out: the compiled decode step's pad rows
        # write their K/V there (engine.core.decode_graphs), never into a sequence's block
        self.scratch_block = blocks
        self.cache = KVCache(mc.num_layers, blocks + 1, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                             self.dtype, self.device)
        self.blocks = BlockManager(blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        self.adapters = None  # AdapterManager once enable_lora() ran
        self.directory = AdapterDirectory(self.model_name)  # the base only until enable_lora()
        self.scheduler = Scheduler(self.blocks, max_batch_size=cfg.max_batch_size,
                                   max_batched_tokens=prefill_tokens(cfg, self.device.type))
        self.runner = ModelRunner(self.model, self.cache, self.device)
        # token-level stop checks and deltas only: text and stop strings are the API side's
        self.output = TokenOutputs(mc.eos_token_ids or self.tokenizer.eos_token_ids, self.max_model_len)
        self.default_gen = torch.Generator().manual_seed(cfg.seed)
        self.seqs: dict[str, Sequence] = {}
        self._waiting_for: dict[AdapterKey, list[Sequence]] = {}  # parked sequences by adapter
        self._asked = False  # page-ins were asked for since the last step (`_drain_page_ins`)
        self._decode_first = False  # this step decodes before it admits (`_drain_page_ins`)
        self.last_batch_size = 0
        self.decode_step_s = 0.0  # a decode step's forward and sampling, smoothed (a training slice's quantum)
        self._notify = lambda: None  # wakes the owner thread when a page-in completes
        # the CPU decode step's BackgroundCompile while it makes graphs (engine.core.build)
        self.compiler = None
        self.snapshot = EngineSnapshot(max_lora=0)
        # structured output's compiler: its tokenizer info is built now, on its own worker, so
        # the first constrained request does not wait for it
        self.grammars = GrammarEngine(self.tokenizer, self.vocab_size, sorted(self.output.eos),
                                      compile_timeout_s=cfg.grammar_compile_timeout_s)

    def enable_lora(self, manager, state) -> None:
        """Serve adapters: admission goes through the manager, the runner feeds the wrappers."""
        self.adapters = manager
        self.directory = AdapterDirectory(self.model_name, manager.catalog, manager.base_fingerprint,
                                          manager.pool.limits)
        manager.notify = self._notify
        self.scheduler.gate = manager
        self.runner.lora = state
        self.publish()

    # -- requests: any thread -------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """Stateless checks. Raises EngineError (400)."""
        req.check(self.vocab_size, self.max_model_len)

    def resolve_adapter(self, ref: str | None):
        """'tenant/name[@rev]' -> the RevisionRecord a request runs on; None = base only, for an
        in-process caller that names its adapter only (`add_request`: tests, bench). A catalog
        read through the same `AdapterDirectory` the API side uses; the serving path resolves
        there, at the edge, and hands the engine the record. Raises catalog errors, or
        EngineError 400/404."""
        return None if ref is None else self.directory.resolve(ref, EVERYONE).record

    def make_sequence(self, req: GenerateRequest, record=None) -> Sequence:
        gen = torch.Generator().manual_seed(req.params.seed) if req.params.seed is not None else None
        key = (record.adapter_id, record.revision) if record is not None else None
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params, key,
                       adapter_ref=req.adapter if key is not None else None, generator=gen,
                       adapter_record=record, tenant=req.tenant, tenant_weight=req.tenant_weight)
        if req.params.structured is not None:
            # compiled (cached by kind and text) on the grammar workers; the engine core admits
            # a request once its grammar is compiled (`grammars.prepare`), so this waits only
            # for a caller that did not. EngineError 400 for a grammar that does not compile.
            seq.matcher = self.grammars.matcher(req.params.structured)
        return seq

    # -- requests and commands: engine thread ---------------------------------------------------
    def add_sequence(self, seq: Sequence, blob: bytes | None = None) -> None:
        """Queue seq; when its revision must be paged in first, park it until it is. `blob`:
        the revision's blob, read at the edge with its record (`messages.Add.blob`): that
        page-in then reads nothing, and lands by this thread's next step."""
        if seq.request_id in self.seqs:
            raise EngineError(f"duplicate request id {seq.request_id!r}")
        key = seq.adapter_key
        if key is not None:
            self.adapters.check_servable(key)  # a quarantined revision: this request fails alone
            seq.adapter_tier = self.adapters.tier_of(key)  # for the request's log line
        self.seqs[seq.request_id] = seq
        if key is None or self.adapters.is_ready(key):
            self.scheduler.add(seq)
            return
        self.scheduler.park(seq)
        self._waiting_for.setdefault(key, []).append(seq)
        if self.adapters.fetch(seq.adapter_record, blob):  # once per key until it settles
            self._asked = True  # a catalog read: the next step gives it time to land

    def set_notify(self, wake) -> None:
        """wake() is called from other threads when the engine has new work (a page-in landed)."""
        self._notify = wake
        if self.adapters is not None:
            self.adapters.notify = wake

    def abort(self, request_id: str) -> RequestOutput | None:
        """End request_id and free its KV blocks and adapter slot: nobody waits for it any more,
        or one of its stop strings ended it on the API side."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self._forget(seq)
        seq.finish_reason = "abort"
        return self.output.delta(seq)

    def unload_adapter(self, adapter_id: str) -> int:
        """Drop adapter_id's revisions from the device pool (unless in use) and the CPU tier."""
        evicted = self.adapters.unload(adapter_id)
        self.publish()
        return evicted

    def fail_all(self, exc: Exception) -> list[RequestOutput]:
        """After an internal error: end every request with a 500 so no client hangs."""
        err = EngineError(f"internal error: {exc}", status=500, code="internal_error")
        outs = []
        for seq in list(self.seqs.values()):
            self._forget(seq)
            outs.append(self.output.error(seq, err))
        self.seqs.clear()
        return outs

    def _forget(self, seq: Sequence) -> None:
        """Take seq out of the scheduler and the page-in waiters, freeing what it holds."""
        self.scheduler.remove(seq)
        parked = self._waiting_for.get(seq.adapter_key) if seq.adapter_key else None
        if parked and seq in parked:
            parked.remove(seq)

    # -- the step pipeline ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.scheduler.parked)

    def step(self) -> list[RequestOutput]:
        """One engine step. A fault while handling one sequence fails that sequence (a 500 for
        its request alone, logged with its request id); the rest of the batch goes on."""
        outs = self._drain_page_ins()
        seqs, is_prefill = self.scheduler.schedule(decode_first=self._decode_first)
        self.last_batch_size = len(seqs)
        if is_prefill:  # a sequence's queue time ends when it is first scheduled
            now = time.monotonic()
            for seq in seqs:
                seq.scheduled_time = seq.scheduled_time or now
        if not seqs and self.compiler is not None:
            self.compiler.idle_turn()  # when idle: times a freshly compiled decode bucket
        if seqs:
            started = time.perf_counter()  # the step's own work: not the page-ins drained before it
            seqs, result = self._run(seqs, is_prefill, outs)
            seqs, result = self._screen(seqs, result, outs)
            if seqs:
                self._advance(seqs, result, outs)
                self._sample(seqs, result, outs)
                outs.extend(self._postprocess(seqs))
            if not is_prefill:
                took = time.perf_counter() - started
                self.decode_step_s = took if not self.decode_step_s else 0.8 * self.decode_step_s + 0.2 * took
        self.publish(force=not self.scheduler.has_work)
        return outs

    def _drain_page_ins(self) -> list[RequestOutput]:
        """Adapters that finished paging in: stage them and unpark their sequences, or fail them.
        Blobs the pager read for this thread are decoded first (AdapterManager.finish_reads).

        When page-ins were asked for since the last step, their requests should join one
        prefill, not trickle into several. If running sequences can decode (and the last step
        did not already put its prefill off), this step decodes them first, without waiting:
        the reads land during that step, and the next one admits their requests together.
        Otherwise it waits up to PAGE_IN_GRACE_S for the reads. The engine thread sets the
        server's rate, and the wait held it idle: 9-20% of its time on a cold workload, where
        the decode first measured cold/warm 0.74-0.88 against 0.70-0.79 (bench/RESULTS.md,
        session 19). A prompt waiting meanwhile is put off by one decode step, never two in a
        row."""
        outs = []
        deferred, self._decode_first = self._decode_first, False
        if self.adapters is not None:
            if self._asked:
                self._asked = False
                if not deferred and self.scheduler.can_decode():
                    self._decode_first = True
                else:
                    self.adapters.wait_reads(PAGE_IN_GRACE_S)
            self.adapters.finish_reads()
        while self.adapters is not None:
            try:
                key, weights, err = self.adapters.page_ins.get_nowait()
            except queue.Empty:
                return outs
            waiters = self._waiting_for.pop(key, [])
            self.adapters.settle(key, weights if err is None else None)
            if err is None:
                for seq in waiters:
                    self.scheduler.unpark(seq)
                continue
            # the revision cannot be read: fail every request that waits for it (parked, or
            # queued after its weights left every tier), and no other
            for seq in [s for s in self.seqs.values() if s.adapter_key == key and s.slot < 0]:
                outs.append(self._fail(seq, err))
        return outs

    def _run(self, seqs: list[Sequence], is_prefill: bool,
             outs: list[RequestOutput]) -> tuple[list[Sequence], StepResult]:
        """The model over seqs. If it raises, the step is narrowed down: its sequences run again
        in halves (a step writes only their own KV slots and changes no sequence state, so a
        re-run is safe) until the ones that fail alone are found; only those fail."""
        try:
            return seqs, self.runner.run(seqs, is_prefill)
        except Exception as exc:
            if len(seqs) == 1:
                outs.append(self._fail(seqs[0], exc, stage="model step"))
                return [], StepResult(is_prefill, torch.empty(0), {})
        mid = len(seqs) // 2
        left, lres = self._run(seqs[:mid], is_prefill, outs)
        right, rres = self._run(seqs[mid:], is_prefill, outs)
        if not left or not right:
            return (left, lres) if left else (right, rres)
        prompt = {**lres.prompt_logits, **{len(left) + b: v for b, v in rres.prompt_logits.items()}}
        return left + right, StepResult(is_prefill, torch.cat([lres.last_logits, rres.last_logits]),
                                        prompt)

    def _screen(self, seqs: list[Sequence], result: StepResult,
                outs: list[RequestOutput]) -> tuple[list[Sequence], StepResult]:
        """Numbers never cross sequences, and a sequence whose numbers went NaN or Inf this step
        fails here, alone, before anything samples from them (`_fail_non_finite`). Padding reads
        only the KV cache's null block (`attention.KVCache`), so a sequence's logits are non-finite
        only through its own weights, tokens or K/V. One reduction of the step's logits to a sum
        per row and one host sync: a NaN or Inf anywhere in a row makes its sum so. On the CPU,
        one read of the logits instead (`cpu_fused.screen_logits`: each value checked, each row's
        argmax taken on the way, kept in `result.picked` for `_sample`'s greedy rows)."""
        if not seqs:
            return seqs, result
        logits = result.last_logits
        prompt_bad = {b for b, v in result.prompt_logits.items() if not bool(torch.isfinite(v.sum()))}
        if cpu_fused.screens(logits):
            result.picked = cpu_fused.screen_logits(logits).tolist()
            bad = {i for i, p in enumerate(result.picked) if p < 0}
        else:
            sums = logits.sum(dim=-1)
            bad = set() if bool(torch.isfinite(sums).all()) else set(
                torch.nonzero(~torch.isfinite(sums)).flatten().tolist())
        if not prompt_bad and not bad:
            return seqs, result
        bad |= prompt_bad
        keep = [i for i in range(len(seqs)) if i not in bad]
        for i in sorted(bad):
            self._fail_non_finite(seqs[i], outs)
        prompt = {j: result.prompt_logits[i] for j, i in enumerate(keep) if i in result.prompt_logits}
        picked = None if result.picked is None else [result.picked[i] for i in keep]
        return [seqs[i] for i in keep], StepResult(result.is_prefill, logits[keep], prompt, picked)

    def _fail_non_finite(self, seq: Sequence, outs: list[RequestOutput]) -> None:
        """End seq, whose logits went non-finite: the KV blocks it wrote leave the prefix cache
        and are zeroed before anyone else can own them, and its revision is quarantined (never
        admitted again by this engine; the snapshot and `/v1/adapters/{id}` show it): requests
        for it not yet admitted fail now rather than wait for ever."""
        key = seq.adapter_key
        what = f"adapter {key[0]}@{key[1]}" if key is not None else "the base model"
        log.error("request %s: non-finite logits on %s", seq.request_id, what)
        self.cache.scrub(self.blocks.discard(seq))
        why = ""
        if key is not None:
            self.adapters.quarantine(key, f"non-finite logits in request {seq.request_id}")
            why = "; the revision is quarantined and no longer served"
        outs.append(self._fail(seq, EngineError(
            f"the model's output went non-finite (NaN or Inf) on {what}{why}",
            status=500, code="non_finite_output", param="model" if key is not None else None)))
        if key is None:
            return
        for other in [s for s in self.seqs.values() if s.adapter_key == key and s.slot < 0]:
            outs.append(self._fail(other, RevisionQuarantined(
                f"adapter {key[0]}@{key[1]} is quarantined and not served: {self.adapters.quarantined[key]}")))

    def _advance(self, seqs: list[Sequence], result: StepResult, outs: list[RequestOutput]) -> None:
        """The step's tokens are in the KV cache: move each sequence on and record its blocks."""
        for seq in seqs:
            seq.num_cached = seq.num_cached + seq.num_scheduled if result.is_prefill else len(seq)
        self.blocks.commit(seqs)
        for b, logits in result.prompt_logits.items():
            self._contained(seqs[b], outs, "prompt logprobs", self.output.set_prompt_logprobs,
                            seqs[b], logits)

    def _sample(self, seqs: list[Sequence], result: StepResult, outs: list[RequestOutput]) -> None:
        """One token for each sequence whose tokens are all computed (not one mid-way through a
        chunked prefill) and that still wants one. Sampled as a batch; if that raises, each
        sequence alone, so that only the faulty ones fail."""
        active = [i for i, s in enumerate(seqs) if s.num_pending == 0 and s.params.max_tokens > len(s.output_ids)]
        if not active:
            return
        if result.picked is not None and all(_plain_greedy(seqs[i].params) for i in active):
            # greedy on the raw logits, no logprobs: each row's argmax, which the screen read
            picked = [(seqs[i], result.picked[i], None) for i in active]
        else:
            try:
                picked = self._pick(result.last_logits[active], [seqs[i] for i in active])
            except Exception:
                picked = [p for i in active
                          for p in self._contained(seqs[i], outs, "sampling", self._pick,
                                                   result.last_logits[[i]], [seqs[i]]) or []]
        now = time.monotonic()
        for seq, token, lp in picked:
            seq.first_token_time = seq.first_token_time or now
            self._contained(seq, outs, "post-processing", self.output.append, seq, token, lp)

    def _pick(self, rows: torch.Tensor, seqs: list[Sequence]) -> list[tuple]:
        """(seq, token, logprob or None) for each row of logits [B, V] (a copy of the step's
        logits, the callers' advanced indexing made it: the sampler may write it unless
        logprobs, which are read from the raw logits, are asked for)."""
        ks = [s.params.logprobs for s in seqs]
        keep = any(k is not None for k in ks)
        tokens = sample(rows, seqs, self.default_gen, self.output.eos, writable=not keep)
        lps = token_logprobs(rows, tokens, [k or 0 for k in ks]) if keep else None
        return [(seq, int(tokens[j]), lps[j] if lps and ks[j] is not None else None)
                for j, seq in enumerate(seqs)]

    def _postprocess(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Finish what is done, free it, and collect every sequence's new token ids. No text:
        the API server's OutputProcessor detokenizes the deltas and applies stop strings (a
        request that one ends comes back here as an abort)."""
        outs = []
        for seq in seqs:
            if seq.request_id not in self.seqs:
                continue  # failed earlier in this step
            if seq.params.max_tokens == 0 and seq.num_pending == 0:
                seq.finish_reason = "length"
            delta = self._contained(seq, outs, "post-processing", self.output.delta, seq)
            if seq.request_id not in self.seqs:
                continue
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                self.seqs.pop(seq.request_id, None)
            if delta is not None:
                outs.append(delta)
        return outs

    def _contained(self, seq: Sequence, outs: list[RequestOutput], stage: str, fn, *args):
        """fn(*args) for seq's sake; if it raises, seq alone fails (its error goes to outs)."""
        if seq.request_id not in self.seqs:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            outs.append(self._fail(seq, exc, stage=stage))
            return None

    def _fail(self, seq: Sequence, exc: BaseException, stage: str | None = None) -> RequestOutput:
        """End seq with an error. `stage` set: a bug in handling it, logged and answered 500."""
        if stage is not None:
            log.error("request %s failed in %s", seq.request_id, stage, exc_info=exc)
            exc = EngineError(f"internal error in {stage} (request {seq.request_id})",
                              status=500, code="internal_error")
        self.seqs.pop(seq.request_id, None)
        self._forget(seq)
        seq.finish_reason = "error"
        return self.output.error(seq, exc)

    # -- what other threads read ----------------------------------------------------------------
    def publish(self, force: bool = True) -> None:
        """Replace the snapshot (at most every PUBLISH_EVERY_S unless forced); its detail is read
        again when forced or DETAIL_EVERY_S after it was last read, else carried over
        (`engine.snapshot`)."""
        now = time.monotonic()
        last = self.snapshot
        if not force and now - last.published < PUBLISH_EVERY_S:
            return
        sch, b = self.scheduler, self.blocks
        waiting = [*sch.waiting, *sch.parked.values()]
        if force or now - last.detail_at >= DETAIL_EVERY_S:
            detail = self._detail(now)
        else:
            detail = {name: getattr(last, name) for name in DETAIL_FIELDS}
        mgr = self.adapters
        self.snapshot = EngineSnapshot(
            running=len(sch.running), waiting=len(sch.waiting), parked=len(sch.parked),
            batch_size=self.last_batch_size, kv_usage=b.usage, preemptions=sch.num_preemptions,
            prefix_cache_hit_rate=b.prefix_hit_tokens / b.prefix_query_tokens if b.prefix_query_tokens else 0.0,
            prefix_cache_queries=b.prefix_query_tokens, prefix_cache_hits=b.prefix_hit_tokens,
            running_adapters=tuple(sorted({s.adapter_ref for s in sch.running if s.adapter_ref})),
            waiting_adapters=tuple(sorted({s.adapter_ref for s in waiting if s.adapter_ref})),
            max_lora=mgr.pool.config.max_slots if mgr is not None else 0, num_kv_blocks=b.num_blocks,
            quarantined=tuple((aid, rev, why) for (aid, rev), why in mgr.quarantined.items())
            if mgr is not None else (),
            compile=self.compiler.progress() if self.compiler is not None else (),
            published=now, **detail)

    def _detail(self, now: float) -> dict:
        """The snapshot's DETAIL_FIELDS, read now: the tiers' contents and counters."""
        mgr = self.adapters
        if mgr is None:
            return {"detail_at": now}
        pool = mgr.pool
        return dict(
            resident=frozenset(pool.resident()),
            pinned=tuple(k for k in pool.resident() if pool.entry(k).pinned),
            cpu_resident=tuple(mgr.cpu_cache.recent(CPU_RESIDENT_MAX)),
            pool=pool.stats, cpu_cache=mgr.cpu_cache.stats, pager=mgr.pager.stats,
            page_in_samples=tuple((x.name, x.labels, x.value) for m in mgr.pager.page_in_seconds.collect()
                                  for x in m.samples),
            detail_at=now)

    def stats(self) -> dict:
        return self.snapshot.stats()

    def warm_up(self) -> float:
        """Run one short greedy request on the base through the whole step (a 2-token prefill, then
        WARM_UP_DECODE_STEPS decode steps) before the engine serves, so that the first touch of
        each weight page and the first call of each kernel, allocator pool and sampling op land
        here, not inside a user's first request. On SmolLM2 f32 (2 CPUs) that first request spent
        1.6 s in its prefill and 290 + 90 ms in its first two decode steps (then 20-25 ms each).
        Leaves nothing behind: its KV blocks are freed, it never fills one (no prefix-cache
        entry), greedy draws no random numbers, and the counters it moved (prefix
        lookups, last batch, step time) are put back. Returns the seconds it took."""
        start = time.perf_counter()
        size = self.blocks.block_size
        # two tokens: a prefill of several rows (one row would take the decode step's path)
        prompt = ((self.tokenizer.encode("Hello, world") or [0]) * 2)[:2 if size > 3 else 1]
        # the sequence never fills a KV block, so the prefix cache keeps none of it
        budget = min(WARM_UP_DECODE_STEPS + 1, self.max_model_len - len(prompt), size - 1 - len(prompt))
        if budget < 1:
            return 0.0
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        blocks = self.blocks
        counters = (blocks.prefix_query_tokens, blocks.prefix_hit_tokens, self.scheduler.num_preemptions)
        self.add_request(GenerateRequest("loraserve-warm-up", prompt, params))
        while self.has_work():
            self.step()
        blocks.prefix_query_tokens, blocks.prefix_hit_tokens, self.scheduler.num_preemptions = counters
        self.last_batch_size, self.decode_step_s = 0, 0.0
        self.publish()
        took = time.perf_counter() - start
        log.info("warmed up in %.2f s (one %d-token prompt, %d decode steps)", took, len(prompt), budget - 1)
        return took

    # -- convenience ----------------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> Sequence:
        """Validate, resolve the adapter and queue, on the calling thread (tests, bench)."""
        self.validate(req)
        seq = self.make_sequence(req, self.resolve_adapter(req.adapter))
        self.add_sequence(seq)
        return seq

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
