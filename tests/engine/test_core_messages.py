"""How few messages cross between the API server and the engine core, and that nothing is lost.

The core sends one ["step", deltas, snapshot | None] message per step, however many requests the
step served; while it steps without a pause the snapshot goes at most every
SNAPSHOT_EVERY_S, and at once when it idles or a call returns. The API server sends the
commands one turn of its event loop queued as one ["batch", ...] message, in order.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from loraserve.demo import build_demo
from loraserve.engine.core import process as core_module
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.process import EngineCore
from loraserve.engine.client.core_client import CoreClient
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import GenerateRequest, RequestOutput, SamplingParams
from loraserve.engine.wire import pack, request_to_wire, unpacker

WAIT_S = 30


class StubEngine:
    """What EngineCore and EngineLoop use of an LLMEngine: every added request finishes in the
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

    def make_sequence(self, req, record):
        return req

    def add_sequence(self, seq) -> None:
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

    def send(self, msg: list) -> None:
        self.sock.sendall(pack(msg))

    def receive(self, until, timeout_s: float = WAIT_S) -> list[list]:
        """Messages from the core until `until(messages)` holds."""
        got: list[list] = []
        deadline = time.monotonic() + timeout_s
        while True:
            got += list(self.messages)
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
    core = EngineCore(engine, theirs)
    thread = threading.Thread(target=core.serve, daemon=True)
    thread.start()
    peer = Peer(mine)
    peer.send(["hello"])
    assert peer.receive(lambda msgs: msgs)[0][0] == "ready"
    try:
        yield engine, peer, core
    finally:
        mine.close()  # the core stops at the end of its socket (see the last test)
        thread.join(WAIT_S)
        core.close()


def _request(rid: str) -> list:
    req = GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1))
    return ["add", request_to_wire(req), None]


def test_a_batch_of_commands_is_answered_in_one_step_message(served) -> None:
    engine, peer, _ = served
    peer.send(["batch", [_request("a"), _request("b"), _request("gone"), ["abort", "gone"],
                         _request("c")]])
    got = peer.receive(lambda msgs: any(m[1] for m in msgs))
    with_outputs = [m for m in got if m[1]]
    assert len(with_outputs) == 1 and with_outputs[0][0] == "step"
    assert [o[0] for o in with_outputs[0][1]] == ["a", "b", "c"]  # in order; the aborted one not
    assert all(o[5] == "length" for o in with_outputs[0][1])


def test_the_snapshot_is_rate_limited_while_busy_and_sent_when_idle(served, monkeypatch) -> None:
    engine, peer, _ = served
    monkeypatch.setattr(core_module, "SNAPSHOT_EVERY_S", 0.05)
    engine.busy_steps = 10**9  # step busily from the next command on ...
    peer.send(_request("start"))
    peer.receive(lambda msgs: any(m[1] for m in msgs))
    time.sleep(0.5)
    steps_busy = engine.steps
    engine.busy_steps = 0  # ... then idle
    got = peer.receive(lambda msgs: any(m[2] is not None and m[2]["running"] == 0 for m in msgs))
    snaps = [m[2] for m in got if m[2] is not None]
    assert steps_busy > 10 * len(snaps)  # far fewer snapshots than steps (~0.5 s / 0.05 s of them)
    assert len(snaps) <= 0.5 / 0.05 + 3
    last = snaps[-1]
    assert last["running"] == 0 and last["preemptions"] >= steps_busy  # the idle state, at once


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> EngineConfig:
    demo = build_demo(tmp_path_factory.mktemp("core-messages") / "demo")
    return EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), device="cpu",
                        max_model_len=128, max_batch_size=8, torch_threads=1)


async def _concurrent_then_unload(cfg) -> tuple[list[list], list, EngineSnapshot, EngineSnapshot]:
    client = CoreClient(cfg)
    try:
        await client.start()
        sent: list[list] = []
        send = client._send
        client._send = lambda msg: (sent.append(msg), send(msg))[1]

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
    adds = [m for m in sent if m[0] == "add"] + [c for m in sent if m[0] == "batch"
                                                 for c in m[1] if c[0] == "add"]
    assert len(adds) == 6 and all(len(t) == 3 for t in tokens)
    first = sent[0]  # the five requests of one gather, started in one turn of the loop
    assert first[0] == "batch" and [c[0] for c in first[1]] == ["add"] * 5
    assert any(aid == "demo/pirate" for aid, _ in before.resident)
    assert not any(aid == "demo/pirate" for aid, _ in after.resident)


def test_the_core_stops_when_the_api_server_closes_its_end(served) -> None:
    engine, peer, core = served
    peer.send(_request("x"))
    peer.receive(lambda msgs: any(m[1] for m in msgs))
    peer.sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + WAIT_S
    while core._running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core._running
