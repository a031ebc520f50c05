"""`kernels.tracing.compiling`: True only in the thread torch.compile is tracing.

torch's own `torch.compiler.is_compiling()` is one flag for the process during a compile
session, so the engine thread, stepping eagerly while the background compile thread makes a
graph, read True and ran the paths written for traced graphs. Here one thread compiles a function
while another polls both answers: torch's flag is seen True from the other thread, ours never is,
and inside the traced frame ours is a constant True (no graph break: fullgraph)."""
from __future__ import annotations

import threading
import time

import torch

from loraserve.kernels.tracing import compiling


def test_compiling_is_true_only_in_the_traced_frame_of_the_compiling_thread():
    seen: list[tuple[bool, bool]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append((torch.compiler.is_compiling(), compiling()))
            time.sleep(0.0005)

    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(40):
            x = torch.sin(x) * 2 + x.cos()
        return x + (1.0 if compiling() else 100.0)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        traced = torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(8))
    finally:
        stop.set()
        poller.join()
    eager = f(torch.zeros(8))
    assert any(flag for flag, _ in seen), "torch's process-wide flag was never seen from the other thread"
    assert not any(ours for _, ours in seen)
    assert float(traced[0] - eager[0]) == -99.0  # the traced frame took the compiling branch
    assert not compiling()
