"""How few messages cross between the API server and the engine core, and that nothing is lost.

The core sends one Step(deltas, snapshot | None) message per step, however many requests the
step served; while it steps without a pause the snapshot goes at most every
SNAPSHOT_EVERY_S, and at once when it idles or a call returns. The API server sends the
commands one turn of its event loop queued as one Batch message, in order.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from loraserve.demo import build_demo
from loraserve.engine.core import process as core_module
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.process import EngineCoreProc
from loraserve.engine.client.core_client import CoreClient
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import GenerateRequest, RequestOutput, SamplingParams
from loraserve.engine.messages import Abort, Add, Batch, Hello, Message, Ready, Step, decode, encode
from loraserve.engine.wire import unpacker

WAIT_S = 30


class StubEngine:
    """What EngineCore uses of an LLMEngine: every added request finishes in the
    next step with one token; `busy_steps` more steps run a batch of nothing in particular, each
    publishing a new snapshot (`preemptions` counts the steps, so the last one is recognizable)."""

    model_name, max_model_len, vocab_size, adapters = "stub", 64, 100, None

    def __init__(self) -> None:
        self.snapshot = EngineSnapshot()
        self.scheduler = SimpleNamespace(has_work=False)
        self.last_batch_size = 0
        self.pending: list = []
        self.busy_steps = 0
        self.steps = 0

    def set_notify(self, wake) -> None:
        pass

    def publish(self, force: bool = True) -> None:  # the snapshot EngineCore publishes at start
        pass

    def make_sequence(self, req, record):
        return req

    def add_sequence(self, seq, blob=None) -> None:
        self.pending.append(seq)

    def abort(self, request_id: str) -> None:
        self.pending = [s for s in self.pending if s.request_id != request_id]

    def step(self) -> list[RequestOutput]:
        seqs, self.pending = self.pending, []
        busy = bool(seqs) or self.busy_steps > 0
        self.busy_steps = max(0, self.busy_steps - (not seqs))
        self.last_batch_size = int(busy)
        self.steps += 1
        self.snapshot = EngineSnapshot(running=self.last_batch_size, preemptions=self.steps,
                                       published=time.monotonic())
        return [RequestOutput(s.request_id, [7], "", finish_reason="length", num_prompt_tokens=1,
                              num_output_tokens=1) for s in seqs]


class Peer:
    """The API server's end of the socket pair, driven by hand."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.messages = unpacker()

    def send(self, msg: Message) -> None:
        self.sock.sendall(encode(msg))

    def receive(self, until, timeout_s: float = WAIT_S) -> list[Message]:
        """Messages from the core until `until(messages)` holds."""
        got: list[Message] = []
        deadline = time.monotonic() + timeout_s
        while True:
            got += [decode(f) for f in self.messages]
            if until(got):
                return got
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            data = self.sock.recv(1 << 16)
            assert data, f"the core closed the socket; got {got}"
            self.messages.feed(data)


@pytest.fixture
def served():
    """A core over a StubEngine serving on its own thread; (engine, peer, core)."""
    engine = StubEngine()
    mine, theirs = socket.socketpair()
    core = EngineCoreProc(engine, theirs)
    thread = threading.Thread(target=core.serve, daemon=True)
    thread.start()
    peer = Peer(mine)
    peer.send(Hello())
    assert any(isinstance(m, Ready) for m in peer.receive(
        lambda msgs: any(isinstance(m, Ready) for m in msgs)))
    try:
        yield engine, peer, core
    finally:
        mine.close()  # the core stops at the end of its socket (see the last test)
        thread.join(WAIT_S)
        core.close()


def _request(rid: str) -> Add:
    return Add(GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1)), None)


def _with_outputs(msgs: list[Message]) -> list[Step]:
    return [m for m in msgs if isinstance(m, Step) and m.outputs]


def test_a_batch_of_commands_is_answered_in_one_step_message(served) -> None:
    engine, peer, _ = served
    peer.send(Batch((_request("a"), _request("b"), _request("gone"), Abort("gone"),
                     _request("c"))))
    got = peer.receive(_with_outputs)
    with_outputs = _with_outputs(got)
    assert len(with_outputs) == 1
    assert [o.request_id for o in with_outputs[0].outputs] == ["a", "b", "c"]  # in order; not the aborted one
    assert all(o.finish_reason == "length" for o in with_outputs[0].outputs)


def test_the_snapshot_is_rate_limited_while_busy_and_sent_when_idle(served, monkeypatch) -> None:
    engine, peer, _ = served
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 0.05)
    engine.busy_steps = 10**9  # step busily from the next command on ...
    peer.send(_request("start"))
    peer.receive(_with_outputs)
    time.sleep(0.5)
    steps_busy = engine.steps
    engine.busy_steps = 0  # ... then idle
    got = peer.receive(lambda msgs: any(isinstance(m, Step) and m.snapshot is not None
                                        and m.snapshot.running == 0 for m in msgs))
    snaps = [m.snapshot for m in got if isinstance(m, Step) and m.snapshot is not None]
    assert steps_busy > 10 * len(snaps)  # far fewer snapshots than steps (~0.5 s / 0.05 s of them)
    assert len(snaps) <= 0.5 / 0.05 + 3
    last = snaps[-1]
    assert last.running == 0 and last.preemptions >= steps_busy  # the idle state, at once


def test_the_snapshot_detail_is_sent_only_when_the_engine_read_it_again(served, monkeypatch) -> None:
    """While busy, the engine reads its snapshot's detail (the tiers' contents) only now and
    then and carries it over in between; the core sends a snapshot with its detail only when
    the detail was read again since the last one sent, and the receiver keeps its own."""
    engine, peer, _ = served
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 0.0)  # a snapshot with every step
    step = engine.step

    def stepping():
        outs = step()
        n = engine.steps // 5  # the detail is read again every fifth step
        engine.snapshot = dataclasses.replace(engine.snapshot, resident=frozenset({("a", str(n))}),
                                              cpu_resident=(("b", str(n)),), detail_at=float(n + 1))
        return outs

    engine.step = stepping
    engine.busy_steps = 40
    peer.send(_request("start"))
    got = peer.receive(lambda msgs: sum(isinstance(m, Step) and m.snapshot is not None
                                        for m in msgs) >= 30)
    held, with_detail = EngineSnapshot(), 0
    for msg in (m for m in got if isinstance(m, Step) and m.snapshot is not None):
        if msg.detail:
            with_detail += 1
        else:  # sent without it: none of it on the wire, the receiver's kept
            assert msg.snapshot.resident == frozenset() and msg.snapshot.detail_at == 0.0
        held = msg.snapshot if msg.detail else msg.snapshot.with_detail_of(held)
        n = held.preemptions // 5
        assert held.detail_at == n + 1
        assert held.resident == frozenset({("a", str(n))}) and held.cpu_resident == (("b", str(n)),)
    assert 5 <= with_detail <= 10  # one per detail read (every fifth of >= 30 steps), no more


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> EngineConfig:
    demo = build_demo(tmp_path_factory.mktemp("core-messages") / "demo")
    return EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), device="cpu",
                        max_model_len=128, max_batch_size=8, torch_threads=1)


async def _concurrent_then_unload(cfg) -> tuple[list[Message], list, EngineSnapshot, EngineSnapshot]:
    client = CoreClient(cfg)
    try:
        await client.start()
        sent: list[Message] = []
        write = client.transport._write
        client.transport._write = lambda msg: (sent.append(msg), write(msg))[1]

        async def one(i: int) -> list[int]:
            req = GenerateRequest(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True))
            return [t async for out in client.generate(req) for t in out.token_ids]

        tokens = await asyncio.gather(*(one(i) for i in range(5)))
        async for _ in client.generate(GenerateRequest("p", [1, 2], SamplingParams(max_tokens=1),
                                                       "demo/pirate")):
            pass
        while not any(aid == "demo/pirate" for aid, _ in client.snapshot.resident):
            await asyncio.sleep(0.01)
        before = client.snapshot
        await client.unload_adapter("demo/pirate")
        return sent, tokens, before, client.snapshot  # read right after the call returned
    finally:
        await client.shutdown()


def test_client_batches_one_loop_turn_and_a_call_returns_after_its_snapshot(cfg) -> None:
    sent, tokens, before, after = asyncio.run(_concurrent_then_unload(cfg))
    adds = [m for m in sent if isinstance(m, Add)] + [c for m in sent if isinstance(m, Batch)
                                                      for c in m.messages if isinstance(c, Add)]
    assert len(adds) == 6 and all(len(t) == 3 for t in tokens)
    first = sent[0]  # the five requests of one gather, started in one turn of the loop
    assert isinstance(first, Batch) and [type(c) for c in first.messages] == [Add] * 5
    assert any(aid == "demo/pirate" for aid, _ in before.resident)
    assert not any(aid == "demo/pirate" for aid, _ in after.resident)


def test_the_core_stops_when_the_api_server_closes_its_end(served) -> None:
    engine, peer, core = served
    peer.send(_request("x"))
    peer.receive(_with_outputs)
    peer.sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + WAIT_S
    while core._open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core._open


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 3 << 20), min_size=1, max_size=8),
       reads=st.lists(st.integers(1, 1 << 18), min_size=1, max_size=16))
def test_what_the_socket_does_not_take_waits_uncopied_and_arrives_in_order(sizes, reads) -> None:
    """Writes larger than the socket takes (a revision's blob is tens of MB) behind a reader that
    takes a little at a time: every byte arrives, in order, and what waits is views of the very
    objects written (no copy of the queue per turn: that once held every stream for 10-20 s
    while eight saves' blobs drained)."""
    mine, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    core = EngineCoreProc(StubEngine(), theirs)
    try:
        written = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
        got = bytearray()
        mine.setblocking(False)
        for i, data in enumerate(written):
            core._write(data)
            assert all(any(view.obj is w for w in written) for view in core._unsent)
            with contextlib.suppress(BlockingIOError):
                got += mine.recv(reads[i % len(reads)])
        while core._unsent or len(got) < sum(sizes):
            core._write(b"")  # the turn's call when the poll says writable
            with contextlib.suppress(BlockingIOError):
                got += mine.recv(1 << 20)
        assert bytes(got) == b"".join(written)
    finally:
        mine.close()
        core.close()
