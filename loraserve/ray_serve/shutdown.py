"""How `loraserve serve --replicas N` ends: signals, the Ray head's health, bounded steps, and
the processes left behind. No Ray import here (launch.run puts the pieces together).

- `StopSignals`: SIGTERM and SIGINT alike. The first asks for the drain (while the server still
  starts, it ends the start instead); the second hurries it (requests in flight end now, with a
  clean error); the third gives up the orderly stop (what is left is killed).
- `HeadWatch`: while serving, whether the Ray head is still there. A local Ray: its raylet and
  GCS server processes are alive. A joined cluster: its GCS answered within `grace_s`.
- `bounded`: run one shutdown step on a thread, give up on it after a time (a Ray call to a dead
  GCS must not hang the process), or at once when `give_up()` says so.
- `become_subreaper` / `reap_adopted` / `kill_descendants`: the process that started a local Ray
  adopts every orphan of its tree (PR_SET_CHILD_SUBREAPER), so when the raylet goes its workers
  and agents are still found among its descendants, and are stopped before it exits.
- `exit_now`: flush, then os._exit: after the stop, nothing is left for interpreter teardown to
  do, and Ray's C++ core worker may abort in it (SIGABRT) once its cluster is gone.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

log = logging.getLogger(__name__)

# exit statuses of `serve --replicas` (docs/DEPLOY.md, Scaling out)
EXIT_STOPPED = 0      # stopped on SIGTERM/SIGINT: drained (or hurried by a second signal), Ray stopped
EXIT_FAILED = 1       # the Ray head was lost, a stop step overran its bound, or a third signal

_PR_SET_CHILD_SUBREAPER = 36


class StopSignals:
    """SIGTERM/SIGINT counted: `first` (drain), `hurry` (second), `abandon` (third). The handler
    only sets these: it never raises into whatever the main thread runs (Ray's code)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []
        self.first = threading.Event()
        self.hurry = threading.Event()
        self.abandon = threading.Event()

    def install(self) -> None:
        """(Re)install the handlers; main thread only."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.names.append(signal.Signals(signum).name)
        (self.first, self.hurry, self.abandon)[min(self.count, 3) - 1].set()


class HeadWatch:
    """Whether the Ray head is still there; `lost()` is None while it is, else what is gone."""

    def __init__(self, check: Callable[[], str | None], every_s: float = 0.5):
        self._check = check
        self.every_s = every_s
        self._next = 0.0
        self._lost: str | None = None
        self.closed = threading.Event()  # ends a remote watch's probe thread

    def close(self) -> None:
        self.closed.set()

    def lost(self) -> str | None:
        if self._lost is None and time.monotonic() >= self._next:
            self._next = time.monotonic() + self.every_s
            try:
                self._lost = self._check()
            except Exception as exc:  # a watch that cannot look says nothing is lost
                log.debug("head watch failed: %s", exc)
        return self._lost

    @classmethod
    def local(cls, processes: dict[str, Any]) -> HeadWatch:
        """A local Ray: `processes` (name -> psutil.Process: the raylet, the GCS server) run."""
        procs = dict(processes)

        def check() -> str | None:
            for name, p in procs.items():
                if not _alive(p):
                    return f"the local Ray's {name} (pid {p.pid}) exited"
            return None
        return cls(check)

    @classmethod
    def remote(cls, probe: Callable[[], Any], grace_s: float = 30.0,
               every_s: float = 5.0) -> HeadWatch:
        """A joined cluster: `probe` (one small GCS call, on a thread of its own every `every_s`)
        has not succeeded for `grace_s` seconds (a restarting GCS, with fault tolerance, comes
        back sooner than that; a probe that hangs counts as failing)."""
        last_ok = [time.monotonic()]

        def check() -> str | None:
            silent = time.monotonic() - last_ok[0]
            return f"the Ray cluster's GCS has not answered for {silent:.0f} s" \
                if silent >= grace_s else None

        watch = cls(check)

        def probe_loop() -> None:
            while not watch.closed.is_set():
                try:
                    probe()
                    last_ok[0] = time.monotonic()
                except Exception as exc:
                    log.debug("the Ray GCS probe failed: %s", exc)
                watch.closed.wait(every_s)

        threading.Thread(target=probe_loop, name="loraserve-gcs-probe", daemon=True).start()
        return watch


def _name(p: Any) -> str:
    try:
        return p.name()
    except Exception:
        return "process"


def _alive(p: Any) -> bool:
    import psutil
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def bounded(what: str, fn: Callable[[], Any], timeout_s: float,
            give_up: Callable[[], bool] = lambda: False) -> bool:
    """Run fn() on a daemon thread; True when it returned in time without raising. False when
    it raised, ran past `timeout_s`, or `give_up()` turned true meanwhile (the thread is left to
    itself: the process ends soon after)."""
    done = threading.Event()
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # reported below
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=target, name=f"loraserve-stop: {what}", daemon=True).start()
    end = time.monotonic() + timeout_s
    while not done.wait(min(0.1, max(0.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            log.error("%s did not finish in %g s; going on without it", what, timeout_s)
            return False
        if give_up():
            log.warning("%s: given up", what)
            return False
    if error:
        log.warning("%s failed: %s", what, error[0])
        return False
    return True


def become_subreaper() -> bool:
    """Adopt the orphans of this process's tree (Linux; elsewhere False)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_adopted(own: set[int]) -> int:
    """Reap exited children that are not in `own` (orphans adopted as subreaper: nobody else
    waits for them); `own` are the children others wait for (Ray's Popen of raylet, GCS ...)."""
    import psutil
    reaped = 0
    for child in psutil.Process().children():
        if child.pid in own:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE and os.waitpid(child.pid, os.WNOHANG)[0]:
                reaped += 1
        except (psutil.Error, ChildProcessError):
            pass
    return reaped


def kill_descendants(term_wait_s: float = 3.0, kill_wait_s: float = 2.0) -> list[str]:
    """SIGTERM every descendant of this process, SIGKILL those alive after `term_wait_s`, reap
    them; rescans until none is left (a dying raylet may hand us its workers meanwhile).
    Returns what had to be stopped ("name pid" each)."""
    import psutil
    stopped: list[str] = []
    me = psutil.Process()
    for _ in range(3):
        procs = [p for p in me.children(recursive=True) if _alive(p)]
        zombies = [p for p in me.children() if not _alive(p)]
        for p in zombies:
            _reap(p)
        if not procs:
            break
        for p in procs:
            stopped.append(f"{_name(p)} {p.pid}")
            _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=term_wait_s)
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=kill_wait_s)
    for p in me.children():
        _reap(p)
    return stopped


def _signal(p: Any, sig: int) -> None:
    import psutil
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def _reap(p: Any) -> None:
    try:
        os.waitpid(p.pid, os.WNOHANG)
    except ChildProcessError:
        pass


def exit_now(status: int) -> NoReturn:
    """End the process with `status` after flushing logs and stdio, without interpreter
    teardown (see the module's docstring)."""
    try:
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)
