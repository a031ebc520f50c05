"""A run's resume state (factors, Adam moments, step count) written after every step, off the
thread that trains.

The state a core restart puts back must be the last step's, whole: a file that appears by an
atomic rename (`write_atomic`), so a process killed mid-write leaves the previous one. Writing it
must not cost the step: `ResumeWriter.put` takes a copy of the tensors (copy-on-snapshot: the
optimizer updates factors and moments in place, so the next step cannot change what is being
written) and returns; one writer thread serialises and writes. Writes coalesce: a path with a
newer state pending than the one being written gets only the newest (a step the writer fell
behind on is never written on its own, its successor supersedes it).

The thread is started when there is something to write and ends when nothing is pending, so an
idle trainer holds no thread; `flush` waits for every pending write (engine shutdown, tests).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import safetensors.torch
import torch

log = logging.getLogger(__name__)


def write_atomic(path: Path, blob: bytes) -> None:
    """A file that appears whole or not at all (a process killed mid-write keeps the last one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of `tensors`, contiguous, that no later in-place update reaches."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


class ResumeWriter:
    """Writes the newest pending state of each path, one at a time, on a thread of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Path, tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
        self._thread: threading.Thread | None = None
        self.written = 0  # states written (coalesced ones not counted)

    def put(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        """Queue `tensors` (a `snapshot`, owned by the writer from now on) for `path`, replacing a
        state of that path not yet started."""
        with self._lock:
            self._pending[path] = (tensors, metadata)
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="resume-writer", daemon=True)
                self._thread.start()

    def discard(self, path: Path) -> None:
        """Forget a pending state of `path` (its run was dropped)."""
        with self._lock:
            self._pending.pop(path, None)

    def flush(self) -> None:
        """Return once every state queued before this call is on disk."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                path = next(iter(self._pending))
                tensors, metadata = self._pending.pop(path)
            try:
                write_atomic(path, safetensors.torch.save(tensors, metadata=metadata))
                self.written += 1
            except OSError as exc:  # the previous state stays; the next step tries again
                log.error("could not write the resume state %s: %s", path, exc)
