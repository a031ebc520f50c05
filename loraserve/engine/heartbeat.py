"""The engine core's heartbeat, both sides of it.

A beat does not travel on the core's socket: it is two `time.monotonic()` readings the core
writes into a small array shared with the API server (`heartbeat_slots`; both processes read the
same monotonic clock, since a Unix socket pair puts them on one host). The API server reads them
whenever it likes, so a beat is never queued behind step messages, nor read late because the API
server's loop was busy.

- `ALIVE` is written every heartbeat interval by a thread of the core (`Beat`), from the moment
  the process runs (`core_boot.boot_core`, before it imports torch and builds the engine). It goes stale
  when the process stops running: SIGSTOP, a freeze, a C call that holds the GIL.
- `PROGRESS` is written by the core's loop itself at the start of each turn (`EngineCoreProc.serve`;
  the in-thread transport, `AsyncEngine`'s thread, stamps its own the same way),
  and is `LOOP_WAITING` while the loop blocks waiting for a command: waiting is not being stuck,
  however long it lasts. It goes stale when the loop is stuck in one turn (a step that never
  ends), while ALIVE goes on.

`Heartbeat` is the API server's reading: not `beating` once ALIVE is a few beats old (/ready
503 within seconds), and stalled once neither shows progress for the engine timeout. A long
step that runs is thus told apart from a stopped process at once, and from a stuck one only
by the timeout: the timeout bounds one turn of the loop (one step), so `--engine-timeout` must
exceed the longest step a deployment expects (one prefill chunk of `--max-batched-tokens`).
"""
from __future__ import annotations

import threading
import time

ALIVE, PROGRESS = 0, 1  # the heartbeat slots
LOOP_WAITING = -1.0     # PROGRESS while the core's loop waits for a command
HEARTBEAT_S = 0.5       # how often the beat thread writes ALIVE
ENGINE_TIMEOUT_S = 30.0  # `serve --engine-timeout`: no progress this long and the engine is stalled
SUSPECT_BEATS = 4       # ALIVE this many beats old (at least 1 s): not beating


def heartbeat_slots(ctx):
    """New heartbeat slots in memory a process started by `ctx` (a multiprocessing context)
    shares: two doubles, both set to now."""
    slots = ctx.RawArray("d", 2)
    slots[ALIVE] = slots[PROGRESS] = time.monotonic()
    return slots


class Beat:
    """The core's beat thread: ALIVE, every `every_s`, until `stop`. It wakes twice a second and
    writes one float: next to nothing for the engine thread's GIL."""

    def __init__(self, slots, every_s: float = HEARTBEAT_S):
        self.slots = slots
        self.every_s = every_s
        self._stop = threading.Event()
        slots[ALIVE] = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="loraserve-core-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.slots[ALIVE] = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)


class Heartbeat:
    """The API server's reading of one core's slots. Both are the core's `time.monotonic()`,
    read against ours (one host, one clock), so a late look here never makes a live core look
    stalled."""

    def __init__(self, slots, heartbeat_s: float, timeout_s: float):
        self.slots = slots
        self.timeout_s = timeout_s
        self.suspect_s = min(timeout_s, max(SUSPECT_BEATS * heartbeat_s, 1.0))

    def silent_for(self, now: float) -> float:
        """Seconds since the core's beat thread last wrote (a stopped process stops it; a long
        step does not)."""
        return max(0.0, now - self.slots[ALIVE])

    def stuck_for(self, now: float) -> float:
        """Seconds the core's loop has been in its current turn (0 while it waits for work)."""
        progress = self.slots[PROGRESS]
        return 0.0 if progress == LOOP_WAITING else max(0.0, now - progress)

    def beating(self, now: float) -> bool:
        return self.silent_for(now) <= self.suspect_s

    def stalled_for(self, now: float) -> float:
        """Seconds without proof that the core's loop moves: it is stuck in one turn, or the
        process is silent (stopped, or starved) and so cannot show that it is not."""
        return max(self.silent_for(now), self.stuck_for(now))
