"""What a server does before its first request, so that it does not do it during one.

On a 2-CPU machine the decode of a lone request uses both CPUs; anything else the server starts
after /ready takes a core from it. The grammar workers' forkserver imports xgrammar and torch
(seconds of CPU): started after the engine was up, it ran the first requests of a fresh SmolLM2
server at 98 ms a token instead of 24 (bench/RESULTS.md, session 18)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

from loraserve.server import build_app
from .fake_engine import FakeEngine


class _Recording(FakeEngine):
    """Records whether the grammar workers were already starting when the engine started."""

    def __init__(self) -> None:
        super().__init__()
        self.grammars_first: bool | None = None
        self.app = None

    async def start(self) -> None:
        self.grammars_first = self.app.state.ctx.grammars._started is not None
        await super().start()


def test_the_grammar_workers_start_before_the_engine_not_after() -> None:
    engine = _Recording()
    app = engine.app = build_app(engine)

    async def cycle() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(cycle())
    assert engine.grammars_first is True
    assert engine.shut_down


class _Failing(FakeEngine):
    async def start(self) -> None:
        raise RuntimeError("the engine could not start")


def test_an_engine_that_fails_to_start_leaves_no_grammar_workers() -> None:
    engine = _Failing()
    app = build_app(engine)
    grammars = app.state.ctx.grammars

    async def cycle() -> None:
        async with app.router.lifespan_context(app):
            pass

    try:
        asyncio.run(cycle())
    except RuntimeError as exc:
        assert "could not start" in str(exc)
    else:
        raise AssertionError("the lifespan went on past a failed engine start")
    assert grammars._closed


def test_a_grammar_worker_imports_neither_the_app_nor_the_catalog() -> None:
    """The forkserver preloads `grammar_worker`; importing the `loraserve.server` package for it
    must not import the app (FastAPI routes, the catalog, the Tinker service)."""
    code = ("import sys, loraserve.server.grammar_worker\n"
            "heavy = [m for m in ('loraserve.server.app', 'loraserve.catalog.importer',"
            " 'loraserve.server.tinker') if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
