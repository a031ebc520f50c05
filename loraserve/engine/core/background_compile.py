"""The CPU decode step, compiled behind the server's back: ready at once, faster when it can be.

Compiling the decode step with inductor takes minutes on a small machine (SmolLM2-135M: 72 s
for the batch-1 graph and 117 s for the batch >= 2 one on 2 shared cores; 10 s and 5 s with a
warm cache). A server that compiled before it answered `/ready` made its users wait for that, so
the engine serves eagerly from the first request, and one low-priority thread makes the graphs
bucket by bucket (batch 1 first: one stream is what a user tries first):

- **Apart from the steps it serves.** The graphs are made over a twin of the model
  (`lora.layers.twin_model`: the same weights, its own LoRA per-step state), so the thread never
  writes what an eager step reads. While it makes a graph it holds `DecodeGraphs.lock`; the
  engine thread only tries that lock and steps eagerly meanwhile (`ModelRunner.run`), so a
  compile never stalls a step.
- **Out of the way.** It begins a bucket only when the engine is idle (or after `MAX_WAIT_S`
  of continuous load, so a busy server still gets its graphs); while the engine has work it
  runs 5 ms in every 105 (`_throttle`: compiling is mostly Python, and Python threads share
  one lock); it and the C++ compilers it starts run at the lowest CPU priority (nice 19).
- **Only where faster.** Each batch bucket, once made, is timed compiled against eager by the
  engine thread itself when idle (`idle_turn`: at the served steps' priority) and admitted only
  if faster; `--compile auto` remembers that choice per base shape and machine
  (`decode_graphs.choice_cache_path`), and a later start makes only the buckets it admitted.
- **Once per machine.** Inductor's artifacts live in `compile_cache_dir()`, keyed by the base's
  shapes, dtype, weight layout, buckets, threads, CPU and torch version (`choice_key`), so a
  second start loads them instead of compiling.
- **Visible.** A log line per bucket, `progress()` for the engine snapshot (`/ready`'s body and
  the `loraserve_decode_buckets` gauge).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .decode_graphs import DecodeGraphs

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0  # a bucket waits at most this long for an idle engine, then compiles anyway
IDLE_POLL_S = 0.2
THROTTLE_PAUSE_S, THROTTLE_RUN_S = 0.1, 0.005  # the compile's share of a busy engine's time
LOWEST_PRIORITY = 19


def compile_cache_dir(key: str) -> Path:
    """Where inductor keeps this base's compiled decode step: $LORASERVE_CACHE (else
    ~/.cache/loraserve)/compile/<key>."""
    root = os.environ.get("LORASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "loraserve")
    return Path(root) / "compile" / key


def use_cache_dir(path: Path) -> None:
    """Point inductor's on-disk caches at `path`, unless the user chose a directory already
    (TORCHINDUCTOR_CACHE_DIR): read when inductor first compiles."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


class BackgroundCompile:
    """Makes `graphs`' buckets on a thread (see the module doc).

    `is_idle` says whether the engine has nothing to step (read from this thread: a stale answer
    only moves a compile by one poll). `eager` holds batch buckets measured before as no faster
    compiled (not made again; None: measure each); `on_measured(graphs)` records a new
    measurement when every bucket is made; `on_change()` runs after each bucket changes state
    (it wakes the engine's owner thread, which publishes the progress and measures)."""

    def __init__(self, graphs: DecodeGraphs, is_idle: Callable[[], bool], eager: set[int] | None = None,
                 on_measured: Callable[[DecodeGraphs], None] | None = None,
                 on_change: Callable[[], None] = lambda: None):
        self.graphs, self.is_idle, self.on_measured = graphs, is_idle, on_measured
        self.on_change = on_change
        self.remembered = eager
        self.todo = [(b, lora) for b in graphs.batch_sizes for lora in graphs.variants(b)
                     if eager is None or b not in eager]
        if eager is not None:
            graphs.eager_batches = set(eager) & set(graphs.batch_sizes)
        # engine-thread calls never compile: a step no graph's guards admit runs eagerly
        graphs.stance = "eager_on_recompile"
        self.state: dict[tuple[int, bool], str] = {k: "pending" for k in self.todo}
        self.seconds = 0.0  # spent making graphs so far
        self.error: BaseException | None = None
        self._unmeasured: list[int] = []  # made, waiting for the engine thread to time them
        self._events, self._run_until = 0, 0.0  # the throttle's (`_throttle`)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-compile", daemon=True)

    def start(self) -> "BackgroundCompile":
        # the compiler's own modules, imported here, before serving: an import the throttled
        # thread made later would hold that module's import lock at 5% speed, and an engine
        # thread needing the module would wait on it (suspected in a 254 s first answer)
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        log.info("decode step: serving eagerly while %d bucket(s) compile in the background",
                 len(self.todo))
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is made (or failed); True when done. Measuring is the
        engine thread's (`idle_turn`): the caller must keep stepping it, or call that itself."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop after the bucket in hand (a compile cannot be interrupted)."""
        self._stop.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def progress(self) -> tuple[tuple[str, str], ...]:
        """(bucket label, state) per bucket: pending | compiling | measuring | compiled | eager |
        failed."""
        return tuple((_label(b, lora), st) for (b, lora), st in sorted(self.state.items()))

    # -- the engine thread ---------------------------------------------------------------------------
    def idle_turn(self) -> None:
        """The engine thread, with nothing to step: time one made bucket compiled against eager
        and admit it if faster (`DecodeGraphs.measure`). Here, not on the compile thread: the
        engine thread runs at the priority the served steps do, so the timing is theirs."""
        graphs = self.graphs
        if not self._unmeasured or not self.is_idle() or not graphs.lock.acquire(blocking=False):
            return
        try:
            b = self._unmeasured[0]
            faster = graphs.measure(b)
        finally:
            graphs.lock.release()
        self._unmeasured.pop(0)
        self._admit((b, False), faster)

    # -- the compile thread --------------------------------------------------------------------------
    def _run(self) -> None:
        sys.setprofile(self._throttle)  # this thread's only
        try:
            _lower_priority()
            for b, lora in self.todo:
                if self._stop.is_set():
                    return
                self._make(b, lora)
            self._wait(lambda: not self._unmeasured)
            if self.remembered is None and self.on_measured is not None and not self._stop.is_set():
                self.on_measured(self.graphs)
            log.info("decode step: background compile finished in %.1f s; compiled buckets %s, "
                     "eager %s", self.seconds, sorted(self.graphs.ready) or "none",
                     sorted(self.graphs.eager_batches) or "none")
        except BaseException as exc:  # noqa: BLE001 -- the engine goes on eagerly; say why
            self.error = exc
            log.exception("decode step: background compile failed; serving eagerly")
        finally:
            sys.setprofile(None)
            self._done.set()
            self.on_change()

    def _make(self, b: int, lora: bool) -> None:
        key, graphs = (b, lora), self.graphs
        # the bucket below first: timed (its base-only step) and admitted or left eager
        self._wait(lambda: not self._unmeasured)
        if b in graphs.eager_batches:  # its base-only step measured no faster: nor would this
            self._set(key, "eager")
            return
        self._wait(self.is_idle)
        self._set(key, "compiling")
        start = time.perf_counter()
        try:
            with graphs.lock:
                graphs.make(b, lora)
                graphs.ready.discard(key)  # admitted once measured
        except Exception:  # noqa: BLE001 -- this bucket stays eager; the others go on
            self._set(key, "failed")
            log.exception("decode step: compiling bucket %s failed; it runs eagerly", _label(b, lora))
            return
        took = time.perf_counter() - start
        self.seconds += took
        log.info("decode step: bucket %s compiled in %.1f s", _label(b, lora), took)
        if lora or self.remembered is not None:  # LoRA graphs follow their base bucket's timing
            self._admit(key, True)
        else:
            self._unmeasured.append(b)
            self._set(key, "measuring")  # wakes the engine thread, which times it when idle

    def _admit(self, key: tuple[int, bool], faster: bool) -> None:
        graphs = self.graphs
        usable = faster and key[0] not in graphs.eager_batches
        if usable:
            graphs.ready.add(key)
        self._set(key, "compiled" if usable else "eager")
        if not key[1] and key[0] in graphs.timings:
            eager_ms, graph_ms = graphs.timings[key[0]]
            log.info("decode step: bucket %s eager %.1f ms, compiled %.1f ms a step: %s",
                     _label(*key), 1e3 * eager_ms, 1e3 * graph_ms,
                     "compiled in use" if usable else "eager is as fast, kept eager")

    def _set(self, key: tuple[int, bool], state: str) -> None:
        self.state[key] = state
        self.on_change()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Until `ready()`, at most MAX_WAIT_S (a busy engine still gets its graphs)."""
        waited = 0.0
        while not self._stop.is_set() and not ready() and waited < MAX_WAIT_S:
            time.sleep(IDLE_POLL_S)
            waited += IDLE_POLL_S

    def _throttle(self, frame, event, arg) -> None:
        """This thread's profile hook: while the engine has work, the compiler runs
        THROTTLE_RUN_S at a time between THROTTLE_PAUSE_S sleeps. Python threads share one
        interpreter lock, and an inductor compile is mostly Python: unthrottled, it took the
        lock from a served step at every one of its ops (one stream fell from 18 to 1.6
        tokens/s). Never a wait without end: the thread always moves on, 5% of the time, so
        what it holds (a lock, an import) is let go, if slowly."""
        self._events += 1
        if self._events & 1023:
            return
        now = time.monotonic()
        if now < self._run_until:
            return
        if not self.is_idle():
            time.sleep(THROTTLE_PAUSE_S)
            self._run_until = time.monotonic() + THROTTLE_RUN_S
        else:
            self._run_until = now + IDLE_POLL_S


def _label(b: int, lora: bool) -> str:
    return f"batch{b}{'+lora' if lora else ''}"


def _lower_priority() -> None:
    """This thread (and the compiler processes it starts) at the lowest CPU priority: Linux
    sets a thread's nice value by its thread id. Best effort elsewhere."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (OSError, AttributeError):
        log.debug("could not lower the compile thread's priority")
