"""The decode step, compiled: the batch and its context padded to fixed shapes (buckets), each
bucket run by a captured CUDA graph (CUDA) or a `torch.compile` graph (CPU).

An eager decode step of a small model is mostly dispatch: on the H200 the demo base spends
4.1-4.4 ms a step whatever the batch, and its 28 LoRA calls add 2.5-6.6 ms of launches
(bench/RESULTS.md). A graph replays all of it at once. Graphs need fixed shapes, so a step of B
sequences whose longest context is C runs in the smallest bucket (B', C') with B' >= B and
C' >= C: pad rows are base-only tokens that write their K/V into a scratch block no sequence owns
and attend to that one slot; pad context positions are masked. Rows of real sequences see exactly
what the eager step computes, and their results are read back from the first B rows.

Every bucket has two graphs, one with the LoRA pass and one without (a step where no sequence has
an adapter skips LoRA entirely, as the eager path does). LoRA metadata lives in fixed buffers
(`LoRAMeta.empty`) that each step rebuilds in place; the adapter pool's tensors are fixed for its
life, and loads and evictions write into them, so a graph always reads the current adapters.

On the CPU the LoRA graphs cover the small batch buckets (`CPU_LORA_MAX_BATCH`; `lora_graphs`
True or False sets all or none): there the torch LoRA backend's per-step plans are host-side
state a graph cannot keep, so a compiled step runs LoRA as plain tensor code the compiler fuses
(`lora.layers.add_lora_traced`: each token's rank rows read in place, two reductions a target).
Through the backend's custom op, which replans on every call, a compiled LoRA step measured 3x
slower than the eager one (bench/RESULTS.md). Base-only steps of the demo
base gained 1.3-1.4x; at other shapes a compiled step can lose (inductor's graphs around oneDNN's
packed GEMMs, which they call through `loraserve::packed_linear` so the weights stay packed), so
on the CPU each batch bucket is timed compiled against eager at start-up (`choose`) and a bucket
where eager is as fast runs eagerly; `--compile auto` remembers that choice per base shape and
machine (`choice_cache_path`).

Prefill, steps larger than the largest bucket and MoE bases (data-dependent expert routing) run
eagerly. Graphs are made at start-up (`warm_up`); after it nothing compiles: a CPU step no graph's
guards admit runs eagerly (the `eager_on_recompile` stance), a CUDA bucket first met later is
captured then.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loraserve.kernels import LoRAMeta

from .attention import KVCache, PagedAttention

if TYPE_CHECKING:
    from ...lora.layers import LoRAState

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 64
# CPU batch buckets whose LoRA steps run through graphs by default (`DecodeGraphs.lora_batches`)
CPU_LORA_MAX_BATCH = 4


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16, and max_batch itself: at most 15 padded rows."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_batch} | set(range(16, max_batch, 16)) | {max_batch}
    return tuple(sorted(sizes))


def context_buckets(max_len: int, block_size: int) -> tuple[int, ...]:
    """Powers of two from 64 up to max_len rounded up to whole blocks: a padded context is never
    more than twice the real one, and the count stays logarithmic."""
    top = -(-max_len // block_size) * block_size
    sizes, c = [], -(-MIN_CONTEXT_BUCKET // block_size) * block_size
    while c < top:
        sizes.append(c)
        c *= 2
    return tuple(sizes) + (top,)


@dataclass(slots=True)
class Padded:
    """One decode step padded to a bucket: what the model reads, plus the real batch size."""

    token_ids: torch.Tensor   # [B'] int64
    positions: torch.Tensor   # [B'] int64
    attn: PagedAttention      # shape (B', 1, C')
    slots: list[int]          # [B'] adapter slot per row, -1 for base-only and pad rows
    batch: int                # B: rows 0..B-1 are real sequences


class _Graph:
    """One captured CUDA graph: its static inputs, its LoRA meta buffers and its output."""

    def __init__(self, ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention,
                 meta: LoRAMeta | None):
        self.ids, self.positions, self.attn, self.meta = ids, positions, attn, meta
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None


class DecodeGraphs:
    """Compiled decode steps over (batch, context) buckets; see the module doc.

    `model` is the runner's model (LoRA wrappers attached, if any), `lora` its `LoRAState` or
    None. The KV cache must have one block beyond those the block manager hands out:
    `scratch_block`, where pad rows write.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device, lora,
                 scratch_block: int, batch_sizes: tuple[int, ...], context_sizes: tuple[int, ...],
                 lora_graphs: bool | None = None):
        self.model, self.cache, self.device, self.lora = model, cache, device, lora
        # steps with LoRA tokens through graphs too: on CUDA by default, on the CPU on request
        # the batch buckets whose LoRA steps run through graphs: every one on CUDA or when asked,
        # the small ones on the CPU (measured at batch 1; larger buckets stay eager, unmeasured)
        every = lora_graphs or device.type == "cuda"
        self.lora_batches = set() if lora is None or lora_graphs is False else {
            b for b in batch_sizes if every or b <= CPU_LORA_MAX_BATCH}
        self.scratch_slot = scratch_block * cache.block_size
        self.batch_sizes, self.context_sizes = batch_sizes, context_sizes
        self.kind = "cuda-graph" if device.type == "cuda" else "inductor"
        self.startup_seconds = 0.0
        self.stance = "default"  # torch.compiler stance of compiled steps: compiles until warm_up ends
        self.steps = 0  # decode steps run through a graph
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}
        self._pool = None
        self._compiled = None
        # CPU batch buckets whose compiled step measured slower than the eager one (`choose`)
        self.eager_batches: set[int] = set()
        self.timings: dict[int, tuple[float, float]] = {}  # batch bucket -> (eager, compiled) s
        # (batch bucket, with LoRA) whose graphs are made: only those serve steps (`bucket`);
        # all of them after `warm_up`, one by one while `BackgroundCompile` makes them
        self.ready: set[tuple[int, bool]] = set()
        # held while a graph runs or is made: the engine thread only tries it (`try_run`) and
        # steps eagerly while a background compile holds it
        self.lock = threading.Lock()
        if self.kind == "inductor":
            # a packed base stays packed: its graphs call the packed GEMM (model.prepack)
            # one graph per bucket and LoRA on/off; dynamo would stop recompiling at 8
            limit = 2 * len(batch_sizes) * len(context_sizes) + 8
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, limit)
            # the batch and context axes are marked dynamic on each call (`_mark_dynamic`), the
            # rest (weights, the cache, head counts) stays static: one graph serves every bucket
            self._compiled = torch.compile(self._forward, dynamic=None)

    # -- buckets -----------------------------------------------------------------------------------
    def bucket(self, batch: int, context: int, has_lora: bool = False) -> tuple[int, int] | None:
        """The smallest (B', C') holding `batch` sequences of at most `context` positions; None
        when none does, or the step has LoRA tokens and LoRA graphs are off."""
        b = next((s for s in self.batch_sizes if s >= batch), None)
        if (b, has_lora) not in self.ready or b in self.eager_batches:
            return None
        c = next((s for s in self.context_sizes if s >= context), None)
        return None if c is None else (b, c)

    def pad(self, ids: list[int], positions: list[int], slots: list[int],
            block_tables: list[list[int]], ends: list[int], bucket: tuple[int, int]) -> Padded:
        """A decode step's inputs padded to `bucket` (one new token per sequence)."""
        b, c = bucket
        n = b - len(ids)
        scratch_block = self.scratch_slot // self.cache.block_size
        tables = block_tables + [[scratch_block]] * n
        starts = [e - 1 for e in ends] + [0] * n
        attn = PagedAttention.build(self.cache, tables, starts, ends + [1] * n, self.device, context=c)
        dev = self.device
        return Padded(torch.tensor(ids + [0] * n, device=dev),
                      torch.tensor(positions + [0] * n, device=dev), attn, slots + [-1] * n, len(ids))

    # -- running -----------------------------------------------------------------------------------
    def forward(self, step: Padded, stance: str | None = None) -> torch.Tensor:
        """Hidden states [B', H] of the padded step (rows >= step.batch are padding). The
        caller holds `lock` (or nothing else runs graphs: `warm_up`)."""
        has_lora = self.lora is not None and max(step.slots) >= 0
        self.steps += 1
        if self.kind == "inductor":
            if self.lora is not None:
                self.lora.set_slots(step.slots)
            _mark_dynamic(step, self.lora if has_lora else None)
            with torch.compiler.set_stance(stance or self.stance):
                return self._compiled(step.token_ids, step.positions, step.attn)
        key = (step.token_ids.numel(), step.attn.shape[2], has_lora)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(*key)
        graph.ids.copy_(step.token_ids)
        graph.positions.copy_(step.positions)
        for name in ("slot_mapping", "kv_index", "mask"):
            getattr(graph.attn, name).copy_(getattr(step.attn, name))
        if graph.meta is not None:
            slots = torch.tensor(step.slots, dtype=torch.int32, device=self.device)
            LoRAMeta.build(slots, max_segments=graph.meta.max_segments, out=graph.meta)
        graph.graph.replay()
        return graph.out

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        return self.model(ids, positions, attn)

    # -- making graphs -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self) -> float:
        """Make every bucket's graphs now (largest first, so CUDA graphs share one memory pool);
        returns the seconds it took, also kept as `startup_seconds`."""
        start = time.perf_counter()
        for b in reversed(self.batch_sizes):
            for has_lora in self.variants(b):
                for c in reversed(self.context_sizes):
                    if self.kind == "cuda-graph":
                        self._capture(b, c, has_lora)
                    else:
                        self.forward(self._dummy(b, c, has_lora))
                self.ready.add((b, has_lora))
        self.startup_seconds = time.perf_counter() - start
        if self.lora is not None:  # no LoRA dummy's slots outlive the warm-up (`choose` runs eagerly)
            self.lora.set_slots([])
        # from now on a step no graph fits (a guard the warm-up did not meet) runs eagerly: a
        # compile while serving stalls the loop for tens of seconds, past the engine timeout
        self.stance = "eager_on_recompile"
        log.info("decode step compiled (%s) for %d batch x %d context buckets in %.1f s",
                 self.kind, len(self.batch_sizes), len(self.context_sizes), self.startup_seconds)
        return self.startup_seconds

    @torch.inference_mode()
    def choose(self, reps: int = 5) -> set[int]:
        """On the CPU, time each batch bucket's compiled step against the eager step of the
        fewest sequences it serves (one more than the bucket below: the compiled step's worst
        case, most padding), interleaved, best of `reps`; buckets where eager is faster run
        eagerly from now on. Returns those buckets (`eager_batches`). A compiled step that
        drops below eager (inductor's own GEMMs at small batch, a graph break) is never used."""
        if self.kind != "inductor":
            return self.eager_batches
        for b in self.batch_sizes:
            self.measure(b, reps)
        log.info("compiled decode step vs eager, ms per step by batch bucket: %s; eager kept for %s",
                 ", ".join(f"{b}: {e * 1e3:.1f}/{g * 1e3:.1f}" for b, (e, g) in self.timings.items()),
                 sorted(self.eager_batches) or "none")
        return self.eager_batches

    @torch.inference_mode()
    def measure(self, b: int, reps: int = 5) -> bool:
        """Time batch bucket `b`'s compiled step against the eager step of the fewest sequences
        it serves (see `choose`); record it in `timings`, and in `eager_batches` when eager is
        as fast. True when the compiled step is faster."""
        c = self.context_sizes[min(1, len(self.context_sizes) - 1)]
        lower = max((s for s in self.batch_sizes if s < b), default=0)
        eager_step, step = self._dummy(lower + 1, c, False), self._dummy(b, c, False)
        runs = (lambda: self._forward(eager_step.token_ids, eager_step.positions, eager_step.attn),
                lambda: self.forward(step))
        best = [float("inf"), float("inf")]
        for _ in range(reps):
            for i, run in enumerate(runs):
                t0 = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - t0)
        self.timings[b] = (best[0], best[1])
        if best[1] >= best[0]:
            self.eager_batches.add(b)
        return best[1] < best[0]

    def variants(self, b: int) -> tuple[bool, ...]:
        """The graphs batch bucket `b` has: base-only, and with LoRA where `lora_batches` says."""
        return (False, True) if b in self.lora_batches else (False,)

    @torch.inference_mode()
    def make(self, b: int, has_lora: bool) -> None:
        """Make (compile) batch bucket `b`'s graph, over every context bucket, and admit it to
        `ready`. The caller holds `lock`; inductor only (CUDA graphs are captured at `warm_up`)."""
        for c in reversed(self.context_sizes):
            self.forward(self._dummy(b, c, has_lora), stance="default")
        if self.lora is not None:
            self.lora.set_slots([])
        self.ready.add((b, has_lora))

    def _dummy(self, b: int, c: int, has_lora: bool) -> Padded:
        """A step of pad rows only (they write the scratch block alone); with LoRA, row 0 is
        tagged slot 0, whose rank is 0 on every target while no adapter is loaded there, and
        whose loaded adapter only changes row 0's discarded output."""
        step = self.pad([], [], [], [], [], (b, c))
        if has_lora:
            step.slots[0] = 0
        return step

    def _capture(self, b: int, c: int, has_lora: bool) -> _Graph:
        """Capture one bucket's CUDA graph over static inputs; later steps copy into them."""
        step = self._dummy(b, c, has_lora)
        meta = None
        if has_lora:
            meta = LoRAMeta.empty(b, min(b, self.lora.max_slots), self.device)
            LoRAMeta.build(torch.tensor(step.slots, dtype=torch.int32, device=self.device),
                           max_segments=meta.max_segments, out=meta)
        graph = _Graph(step.token_ids, step.positions, step.attn, meta)
        lora, saved = self.lora, (self.lora.meta if self.lora is not None else None)
        try:
            if lora is not None:
                lora.meta = meta
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up launches (Triton compiles, cuBLAS handles)
                for _ in range(2):
                    self._forward(graph.ids, graph.positions, graph.attn)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph.graph, pool=self._pool):
                graph.out = self._forward(graph.ids, graph.positions, graph.attn)
        finally:
            if lora is not None:
                lora.meta = saved
        self._graphs[(b, c, has_lora)] = graph
        return graph


# -- the CPU's choice, remembered ---------------------------------------------------------------------
def choice_cache_path() -> Path:
    """Where `--compile auto` keeps its measured choices: $LORASERVE_COMPILE_CACHE, else
    $XDG_CACHE_HOME (~/.cache)/loraserve/compile-choices.json."""
    if os.environ.get("LORASERVE_COMPILE_CACHE"):
        return Path(os.environ["LORASERVE_COMPILE_CACHE"])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "loraserve" / "compile-choices.json"


def choice_key(model_config, dtype: torch.dtype, batch_sizes: tuple[int, ...], packed: bool) -> str:
    """What a measured choice depends on: the base's shapes, dtype and weight layout, the batch
    buckets, the threads, this CPU (model name and flags), torch's version and the code of both
    sides (`code_signature`: a release that makes the eager step faster measures again)."""
    shapes = {k: v for k, v in model_config.to_hf_dict().items() if k not in ("eos_token_id",)}
    cpu = _cpu_signature()
    blob = json.dumps([shapes, str(dtype), list(batch_sizes), packed, torch.get_num_threads(), cpu,
                       torch.__version__, code_signature()], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


_SIGNATURE: list[str] = []


def code_signature() -> str:
    """A hash of the sources an eager or compiled step runs: the model, the kernels (Python and
    C++) and this package's step code (attention, model runner, these graphs); read once."""
    if not _SIGNATURE:
        root = Path(__file__).resolve().parents[2]  # the loraserve package
        files = sorted([*(root / "model").glob("*.py"), *(root / "kernels").glob("*.py"),
                        *(root / "kernels").glob("*.cpp"), *(root / "lora").glob("*.py"),
                        *(Path(__file__).parent / n for n in ("attention.py", "model_runner.py", "decode_graphs.py"))])
        digest = hashlib.sha256()
        for f in files:
            try:
                digest.update(f.name.encode() + b"\0" + f.read_bytes())
            except OSError:
                digest.update(f.name.encode() + b"\0missing")
        _SIGNATURE.append(digest.hexdigest()[:16])
    return _SIGNATURE[0]


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [l for l in lines if l.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.processor()


def read_choice(path: Path, key: str) -> set[int] | None:
    """The eager batch buckets measured before under `key`, or None (none recorded, unreadable)."""
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return None if not isinstance(entry, dict) else set(entry.get("eager_batches", ()))


def write_choice(path: Path, key: str, graphs: "DecodeGraphs") -> None:
    """Record graphs' measured choice under `key` (atomically; best effort: a read-only home
    only means measuring again next start)."""
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    table[key] = {"eager_batches": sorted(graphs.eager_batches),
                  "ms": {str(b): [round(1e3 * e, 3), round(1e3 * g, 3)] for b, (e, g) in graphs.timings.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not record the compile choice in %s: %s", path, exc)


def _mark_dynamic(step: Padded, lora: LoRAState | None) -> None:
    """Tell torch.compile which axes vary between buckets: rows (batch) and context positions;
    with LoRA, the meta's token and segment axes and each token's slot, which follow the batch."""
    attn = step.attn
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (step.token_ids, step.positions, attn.slot_mapping, attn.q_index, attn.q_valid_pos,
              attn.kv_index, attn.mask):
        mark(t, 0)
    mark(attn.mask, 3)
    if lora is not None:
        for t in lora.meta.tensors()[:-1]:  # all but num_segments ([1])
            mark(t, 0)
        mark(lora.token_slots, 0)  # read by the traced LoRA pass (`add_lora_traced`)
