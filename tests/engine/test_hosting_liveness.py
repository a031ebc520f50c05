"""Liveness on every hosting, the same assertions: an engine loop that makes no progress is not
`ready` once the engine timeout passes, and the hosting is ready again afterwards.

- thread (`AsyncEngine`, also what Ray replicas hosted before issue 44): the engine thread
  stamps its progress at each turn and `ready` reads it. Before, `ready` was a constant True, so
  a wedged engine thread reported healthy for ever (a Ray replica's report loop runs on its own
  event loop beside the engine thread and kept reporting it).
- process (`CoreClient`, what `serve` and now each Ray replica host): the stopped core is not
  ready within the suspect window, stalled at the timeout, and replaced.
Ray's own check (a replica whose core is wedged stops reporting, and its core is replaced) is
in tests/test_ray_serve.py, where a cluster runs.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.client.core_client import Backoff, CoreClient
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.engine.types import GenerateRequest, SamplingParams

TIMEOUT_S = 2.0
WAIT_S = 60


def _cfg(base) -> EngineConfig:
    return EngineConfig(model_dir=str(base), device="cpu", dtype="float32", max_model_len=64,
                        torch_threads=1)


async def _until(check, what: str, within_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


class ThreadWedge:
    """The in-thread engine, its step held on an Event while `wedged`."""

    def __init__(self, base):
        self.engine = AsyncEngine(build_engine(_cfg(base)), engine_timeout_s=TIMEOUT_S)
        self.release = threading.Event()
        self.in_step = threading.Event()
        step = self.engine.transport.engine.step

        def held():
            outs = step()
            if self.engine.transport.engine.last_batch_size and not self.release.is_set():
                self.in_step.set()
                self.release.wait()
            return outs

        self.engine.transport.engine.step = held

    async def wedge(self) -> None:
        await asyncio.to_thread(self.in_step.wait, WAIT_S)

    def unwedge(self) -> None:
        self.release.set()

    def replaced(self) -> bool:
        return True  # it moves again once released


class ProcessWedge:
    """The engine-core process, stopped (SIGSTOP) while wedged."""

    def __init__(self, base):
        self.engine = CoreClient(_cfg(base), engine_timeout_s=TIMEOUT_S, heartbeat_s=0.1,
                                 backoff=Backoff(0.1, 1.0))
        self.pid = None

    async def wedge(self) -> None:
        await _until(lambda: self.engine.snapshot.running >= 1, "the request running")
        self.pid = self.engine.core_pid
        os.kill(self.pid, signal.SIGSTOP)

    def unwedge(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:  # killed and reaped by the supervisor
            pass

    def replaced(self) -> bool:
        return self.engine.core_pid not in (None, self.pid)


@pytest.mark.parametrize("hosting", [ThreadWedge, ProcessWedge], ids=["thread", "process"])
def test_a_wedged_engine_loop_is_not_ready_past_the_timeout_then_ready_again(hosting, demo_dense):
    host = hosting(demo_dense)
    eng = host.engine
    req = GenerateRequest("long", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))

    async def main() -> None:
        await eng.start()
        try:
            assert eng.ready
            task = asyncio.create_task(_drain(eng.generate(req)))
            await host.wedge()
            await _until(lambda: not eng.ready, "not ready while wedged", TIMEOUT_S + 10)
            assert eng.unavailable().status == 503
            if hosting is ProcessWedge:  # the supervisor ends it: one clean 503 in flight
                await _until(host.replaced, "a new core", WAIT_S)
            host.unwedge()
            await _until(lambda: eng.ready, "ready again")
            try:
                await task
            except Exception as exc:  # the process hosting ends the wedged request with a 503
                assert getattr(exc, "status", None) == 503, exc
            assert host.replaced()
            more = GenerateRequest("after", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
            assert len(await _drain(eng.generate(more))) == 2
        finally:
            host.unwedge()
            await eng.shutdown()

    asyncio.run(main())


async def _drain(gen) -> list[int]:
    return [t async for out in gen for t in out.token_ids]


def test_a_supervisor_stopped_with_its_core_does_not_call_the_core_stalled(demo_dense):
    """The whole server stopped and resumed (SIGSTOP of its process group, a paused VM): the core
    and its supervisor resume together, and the core's beat is as old as the pause. The supervisor
    knows its own watch did not run meanwhile and counts a stall only from when it resumed: the
    core is kept (same pid, no restart) and serves; a core stopped alone is still replaced (the
    test above). (Judging at the next wake, 50 ms on, killed the live core 1 run in 2 on a busy
    2-CPU host: it had not yet ended the turn it was stopped in.)"""
    host = ProcessWedge(demo_dense)
    eng = host.engine
    req = GenerateRequest("long", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))

    async def main() -> None:
        await eng.start()
        try:
            task = asyncio.create_task(_drain(eng.generate(req)))
            await host.wedge()                 # the core stopped mid-request ...
            time.sleep(TIMEOUT_S * 1.5)        # ... and this event loop (the supervisor) with it
            host.unwedge()                     # both resume together
            await asyncio.sleep(TIMEOUT_S)     # the watch's next wakes judge a moving core
            assert eng.core_pid == host.pid and eng.restarts == 0
            assert len(await task) == 30
            assert eng.ready
        finally:
            host.unwedge()
            await eng.shutdown()

    asyncio.run(main())
