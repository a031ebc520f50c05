"""Ops a compiled graph calls as extern kernels, registered straight with the dispatcher.

`torch.library.custom_op` wraps its function in Python layers (argument binding, an
ADInplaceOrView kernel that bumps versions, backend lookup) that cost ~120 µs a call on the
2-core dev machine; the same function registered with `Library.impl` costs ~23 µs (the body
~10 µs). A 0.6B-shaped compiled decode step on the packed layout calls the GEMM 113 times:
~11 ms a step of wrappers (bench/RESULTS.md, issue 30 session 13). Inductor treats both
registrations alike: an op whose schema marks its in-place arguments stays one in-place call
in the graph.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("loraserve", "FRAGMENT")


def define(name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """`loraserve::<name>` with `schema` (arguments and result, in the dispatcher's syntax): `impl`
    for every backend, `fake` for tracing (shapes only)."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"loraserve::{name}", fake, lib=_LIB)
