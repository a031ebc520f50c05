"""The engine core's heartbeat and the supervisor's backoff, without a core process.

The core writes two timestamps (`heartbeat`): ALIVE from a beat thread, PROGRESS from its loop at the
start of each turn (LOOP_WAITING while it waits for work). What they measure: a loop stuck in
one step stops PROGRESS while ALIVE goes on (stalled once that passes the engine timeout, but
still beating: /ready stays up until then), a long step that ends before the timeout never looks
stalled, and an idle core waiting for commands never does either.
"""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from loraserve.engine.core.process import EngineCoreProc
from loraserve.engine.client.core_client import Backoff
from loraserve.engine.heartbeat import LOOP_WAITING, PROGRESS, Beat, Heartbeat
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import GenerateRequest, RequestOutput, SamplingParams
from loraserve.engine.messages import Add, Hello, Step, decode, encode
from loraserve.engine.wire import unpacker

BEAT_S = 0.05
WAIT_S = 30


class SlowEngine:
    """What EngineCore uses of an LLMEngine: each added request finishes with one token in a
    step that holds until `release` is set (a stuck step), or lasts `step_s` (a long one)."""

    model_name, max_model_len, vocab_size, adapters = "stub", 64, 100, None

    def __init__(self) -> None:
        self.snapshot = EngineSnapshot()
        self.scheduler = SimpleNamespace(has_work=False)
        self.last_batch_size = 0
        self.pending: list = []
        self.release = threading.Event()
        self.release.set()
        self.step_s = 0.0
        self.in_step = threading.Event()

    def set_notify(self, wake) -> None:
        pass

    def publish(self, force: bool = True) -> None:  # the snapshot EngineCore publishes at start
        pass

    def make_sequence(self, req, record):
        return req

    def add_sequence(self, seq, blob=None) -> None:
        self.pending.append(seq)

    def abort(self, request_id: str) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        seqs, self.pending = self.pending, []
        self.last_batch_size = len(seqs)
        if seqs:
            self.in_step.set()
            time.sleep(self.step_s)
            self.release.wait()
            self.in_step.clear()
        return [RequestOutput(s.request_id, [7], "", finish_reason="length", num_prompt_tokens=1,
                              num_output_tokens=1) for s in seqs]


@pytest.fixture
def beating():
    """A core over a SlowEngine on its own thread, beating every BEAT_S into `slots`."""
    engine = SlowEngine()
    mine, theirs = socket.socketpair()
    slots = [0.0, 0.0]
    core = EngineCoreProc(engine, theirs, beat=Beat(slots, BEAT_S))
    thread = threading.Thread(target=core.serve, daemon=True)
    thread.start()
    mine.sendall(encode(Hello()))
    try:
        yield engine, mine, slots
    finally:
        engine.release.set()
        mine.close()
        thread.join(WAIT_S)
        core.close()


def _add(sock: socket.socket, rid: str) -> None:
    req = GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1))
    sock.sendall(encode(Add(req, None)))


def _answered(sock: socket.socket, rid: str) -> None:
    messages = unpacker()
    sock.settimeout(WAIT_S)
    while True:
        for frame in messages:
            msg = decode(frame)
            if isinstance(msg, Step) and any(o.request_id == rid for o in msg.outputs):
                return
        messages.feed(sock.recv(1 << 16))


def _watch(judge: Heartbeat, seconds: float) -> tuple[float, float, bool]:
    """Over `seconds`: the longest the judge saw the loop stuck in one turn, the longest stall,
    and whether it saw the process beating all along."""
    stuck = stalled = 0.0
    beating = True
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        stuck = max(stuck, judge.stuck_for(now))
        stalled = max(stalled, judge.stalled_for(now))
        beating &= judge.beating(now)
        time.sleep(BEAT_S / 5)
    return stuck, stalled, beating


def test_an_idle_core_beats_and_waits_without_looking_stuck(beating) -> None:
    engine, sock, slots = beating
    judge = Heartbeat(slots, BEAT_S, timeout_s=0.3)
    stuck, _, always = _watch(judge, 1.5)  # idle for five timeouts, its poll waking every second
    assert always and stuck < 0.2
    assert slots[PROGRESS] == LOOP_WAITING  # blocked in poll: waiting, not stuck


def test_a_stuck_step_stalls_after_the_timeout_while_the_process_still_beats(beating) -> None:
    engine, sock, slots = beating
    engine.release.clear()
    _add(sock, "stuck")
    assert engine.in_step.wait(WAIT_S)
    judge = Heartbeat(slots, BEAT_S, timeout_s=0.3)
    frozen = slots[PROGRESS]
    stuck, stalled, always = _watch(judge, 0.6)
    assert slots[PROGRESS] == frozen != LOOP_WAITING  # the loop has not moved ...
    assert always  # ... while the beat thread has: the process runs (not stopped)
    assert stuck > 0.5 and stalled > 0.3  # stalled past the timeout
    engine.release.set()
    _answered(sock, "stuck")
    deadline = time.monotonic() + WAIT_S
    while judge.stuck_for(time.monotonic()) >= 0.3:  # it moves again (its next turn)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_long_step_that_ends_in_time_never_looks_stalled(beating) -> None:
    engine, sock, slots = beating
    engine.step_s = 0.2  # several beats long, under the timeout
    judge = Heartbeat(slots, BEAT_S, timeout_s=0.5)
    worst = 0.0
    for i in range(4):
        _add(sock, f"long{i}")
        assert engine.in_step.wait(WAIT_S)
        stuck, _, always = _watch(judge, 0.15)
        assert always  # the beat goes on through the step
        worst = max(worst, stuck)
        _answered(sock, f"long{i}")
    assert 0.1 < worst < 0.45  # as long as a step, never the timeout


def test_a_silent_process_is_not_ready_within_the_suspect_window_and_stalls_at_the_timeout() -> None:
    now = time.monotonic()
    slots = [now, LOOP_WAITING]  # idle when it went quiet (a stopped process writes nothing)
    judge = Heartbeat(slots, heartbeat_s=0.5, timeout_s=3.0)
    assert judge.suspect_s == 2.0
    assert judge.beating(now + 1.9) and not judge.beating(now + 2.1)
    assert judge.stalled_for(now + 2.9) < 3.0 < judge.stalled_for(now + 3.1)
    slots[PROGRESS] = now  # busy when it went quiet: the same verdict
    assert judge.stalled_for(now + 2.9) < 3.0 < judge.stalled_for(now + 3.1)
    assert Heartbeat(slots, heartbeat_s=0.5, timeout_s=1.0).suspect_s == 1.0  # never past it


def test_backoff_doubles_to_its_cap_and_resets_after_a_healthy_core() -> None:
    b = Backoff(initial=0.5, cap=30.0, healthy_s=60.0)
    waits = [b.next(up_for=1.0) for _ in range(9)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert b.next(up_for=0.0) == 30.0  # never came up: no reset
    assert b.next(up_for=61.0) == 0.5  # it served a healthy minute: start over
    assert b.next(up_for=61.0) == 0.5 and b.next(up_for=2.0) == 1.0
    with pytest.raises(ValueError):
        Backoff(initial=0.0)
