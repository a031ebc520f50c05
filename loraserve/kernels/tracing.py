"""`compiling()`: whether *this thread* is being traced by torch.compile.

`torch.compiler.is_compiling()` answers for the process: dynamo sets one module-level flag for
the whole of a compile session (`torch.compiler._compile_session_context`), so while the
background compile thread (engine.core.background_compile) makes a graph, every other thread
reads True too, and the engine thread's eager steps took the paths written for a traced graph
(the cache written by `index_put_` on the whole cache, attention as plain ops, the fused CPU ops
off) for as long as the compile ran. Here the flag counts only with a tracing context on this
thread (dynamo keeps it thread-local); inside a traced frame the answer is a constant (True).
"""
from __future__ import annotations

import torch
from torch._guards import TracingContext


@torch.compiler.assume_constant_result
def _traced_here() -> bool:
    return TracingContext.try_get() is not None


def compiling() -> bool:
    """True inside a frame torch.compile is tracing on this thread; False in eager code on any
    thread, also while another thread compiles."""
    return torch.compiler.is_compiling() and _traced_here()
