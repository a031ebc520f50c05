"""Adapter refs are resolved on the event loop (no thread hop) unless recent reads were slow;
refs resolved moments ago always are. The catalog is still read every time, so what a ref names
is never stale."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from loraserve.engine.client import warm_refs
from loraserve.engine.client.frontend import EngineClient, Transport
from loraserve.engine.config import EngineConfig
from loraserve.engine.messages import Abort, Add
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import GenerateRequest, RequestOutput, SamplingParams
from loraserve.engine.client.warm_refs import WarmRefs
from loraserve.model.tiny import byte_level_tokenizer
from loraserve.tokenizer import Tokenizer


def test_warm_refs_expire_and_stay_bounded(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(warm_refs.time, "monotonic", lambda: now[0])
    refs = WarmRefs(ttl_s=5.0, capacity=2)
    assert not refs.is_warm("a/x")
    refs.touch("a/x")
    assert refs.is_warm("a/x")
    now[0] += 5.1
    assert not refs.is_warm("a/x")
    refs.touch("a/x")
    refs.touch("a/y")
    refs.touch("a/z")  # over capacity: the least recently resolved goes
    assert not refs.is_warm("a/x") and refs.is_warm("a/y") and refs.is_warm("a/z")


class EchoTransport(Transport):
    """Answers every request with one token, on the revision it was sent with."""

    def __init__(self, model_dir) -> None:
        self.cfg = EngineConfig(model_dir=str(model_dir), max_batch_size=8, max_waiting=8)
        self.snapshot = EngineSnapshot()

    def send(self, msg) -> None:
        if isinstance(msg, Add):
            req = msg.request
            out = RequestOutput(req.request_id, [1], "x", finish_reason="length",
                                adapter_revision=msg.record.revision)
            asyncio.get_running_loop().call_soon(self.client._deliver, [out])
        elif not isinstance(msg, Abort):
            raise AssertionError(f"unexpected message to the core: {msg!r}")


class Frontend(EngineClient):
    """An EngineClient over an EchoTransport; records the thread and the revision of each resolve."""

    def __init__(self, model_dir) -> None:
        super().__init__(EchoTransport(model_dir), Tokenizer(byte_level_tokenizer(), [], None))
        self.resolves: list[tuple[str, bool]] = []
        self.revision = "r1"
        self.directory = SimpleNamespace(resolve=self._resolve)  # the AdapterDirectory's one method

    def _resolve(self, ref: str, principal):
        self.resolves.append((self.revision, threading.current_thread() is threading.main_thread()))
        if ref.startswith("missing/"):
            raise LookupError(ref)
        return SimpleNamespace(record=SimpleNamespace(revision=self.revision))


def test_second_resolve_of_a_ref_runs_inline_and_reads_the_catalog_again(demo_dense):
    fe = Frontend(demo_dense)
    fe._warm = WarmRefs(inline_cold=False)  # cold refs on a thread: only warm ones inline

    async def one(i: int, ref: str) -> list[RequestOutput]:
        req = GenerateRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=1), adapter=ref)
        return [o async for o in fe.generate(req)]

    async def go():
        first = await one(0, "acme/a")
        fe.revision = "r2"  # promoted in between: the next resolve must see it
        second = await one(1, "acme/a")
        try:
            await one(2, "missing/b")
        except LookupError:
            pass
        try:
            await one(3, "missing/b")  # a ref that failed is not warm: a thread again
        except LookupError:
            pass
        return first, second

    first, second = asyncio.run(go())
    assert [o.adapter_revision for o in first + second] == ["r1", "r2"]
    assert fe.resolves == [("r1", False), ("r2", True), ("r2", False), ("r2", False)]
    assert fe.admission.in_flight() == 0


def _one(fe, i: int, ref: str) -> list[RequestOutput]:
    async def go():
        req = GenerateRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=1), adapter=ref)
        return [o async for o in fe.generate(req)]
    return asyncio.run(go())


def test_cold_refs_resolve_inline_until_a_read_is_slow(monkeypatch, demo_dense):
    """By default a never-seen ref is read on the event loop; reads slower than `slow_s` (the
    disk, not the page cache; one here) send cold refs to a thread for `backoff_s`, warm refs stay inline,
    and after the back-off cold refs are inline again. Every answer names the current revision."""
    now = [1000.0]
    monkeypatch.setattr(warm_refs.time, "monotonic", lambda: now[0])
    fe = Frontend(demo_dense)
    fe._warm = WarmRefs(ttl_s=5.0, slow_s=0.002, backoff_s=10.0, slow_reads=1)
    assert _one(fe, 0, "acme/a")[0].adapter_revision == "r1"
    assert fe.resolves[-1] == ("r1", True)  # cold, inline
    slow = fe._resolve

    def slow_resolve(ref, principal):  # the read's duration is measured by perf_counter, not the clock above
        time.sleep(0.005)
        return slow(ref, principal)

    fe.directory.resolve = slow_resolve
    _one(fe, 1, "acme/b")  # inline, and slow: cold refs go to a thread now
    assert fe.resolves[-1] == ("r1", True)
    fe.directory.resolve = slow
    fe.revision = "r2"
    assert _one(fe, 2, "acme/c")[0].adapter_revision == "r2"
    assert fe.resolves[-1] == ("r2", False)  # cold, on a thread
    _one(fe, 3, "acme/a")
    assert fe.resolves[-1] == ("r2", True)   # warm: inline whatever the back-off
    now[0] += 10.1                           # back-off over (and every ref's warmth expired)
    _one(fe, 4, "acme/d")
    assert fe.resolves[-1] == ("r2", True)
    assert fe.admission.in_flight() == 0


def test_a_slow_read_backs_off_for_a_while(monkeypatch):
    now = [50.0]
    monkeypatch.setattr(warm_refs.time, "monotonic", lambda: now[0])
    refs = WarmRefs(slow_s=0.002, backoff_s=10.0, slow_reads=1)
    assert refs.inline("a/x")
    refs.timed(0.001)
    assert refs.inline("a/x")
    refs.timed(0.003)
    assert not refs.inline("a/x")
    refs.touch("a/y")
    assert refs.inline("a/y") and not refs.inline("a/x")
    now[0] += 10.0
    assert refs.inline("a/x")
    assert not WarmRefs(inline_cold=False).inline("a/x")


def test_a_slow_read_now_and_then_is_not_the_disk(monkeypatch):
    """A read that waited for a CPU or a collection now and then leaves cold refs inline; reads
    slow `slow_reads` times within `slow_window_s` (a catalog read from the disk) back off."""
    now = [50.0]
    monkeypatch.setattr(warm_refs.time, "monotonic", lambda: now[0])
    refs = WarmRefs(slow_s=0.002, backoff_s=10.0)  # the defaults: 3 slow reads within 1 s
    for _ in range(5):
        refs.timed(0.08)
        now[0] += 0.6
        assert refs.cold_inline()
    now[0] += 2.0
    refs.timed(0.003)
    now[0] += 0.1
    refs.timed(0.003)
    assert refs.cold_inline()
    now[0] += 0.1
    refs.timed(0.003)
    assert not refs.cold_inline()
    now[0] += 10.0
    assert refs.cold_inline()
