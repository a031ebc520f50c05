"""Training never starves serving: the ORDER of the engine loop's work, never its timings.

The engine loop runs one serving step, then at most one training slice of all the training
queued, and that slice only in training's turn of the tenants' fair share (training charged in
tokens, engine/core/training.py, Scheduler.training_turn). `EngineCore.trace` records each turn's
work: "prefill" / "decode" for a serving step that ran a batch, "train" for a slice.

What these hold: however many runs have passes queued, a serving step waits for one slice at most
(at most one "train" between two serving steps, and no turn runs a slice instead of a serving
step that could run); a light tenant's short request that arrives while others train runs whole
before their next slice; one tenant's own serving and training alternate; everything queued
ends. The core process drains every message that arrived before a turn, which is what put N
runs' slices back to back before (N slices between two decode steps): one test drives it.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from loraserve.engine.config import EngineConfig
from loraserve.engine.core import engine_core
from loraserve.engine.core.engine_core import EngineCore
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.process import EngineCoreProc
from loraserve.engine.core.scheduler import Scheduler
from loraserve.engine.core.block_manager import BlockManager
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.core.training import trainer_of
from loraserve.engine.types import GenerateRequest, SamplingParams
from loraserve.engine.messages import Add, Batch, Return, Step, Stop, Train, decode, encode
from loraserve.engine.wire import unpacker

RUN = {"rank": 2, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
SERVING = ("decode", "prefill")


def _datum(n: int, salt: int = 0) -> list:
    toks = [(7 * i + 3 * salt) % 250 + 1 for i in range(n + 1)]
    return [toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * n}]


def _request(rid: str, tenant: str, prompt: int = 6, tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(rid, [(11 * j + len(rid)) % 250 + 1 for j in range(prompt)],
                           SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), tenant=tenant)


@pytest.fixture(scope="module")
def engine(demo_dense) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=256,
                                  torch_threads=1, max_batch_size=8, max_batched_tokens=64))


@pytest.fixture()
def loop(engine):
    """A fresh EngineCore over the shared engine, tracing; the engine is left idle after."""
    loop = EngineCore(engine)
    loop.trace = []
    yield loop
    core = trainer_of(engine)
    for run_id in list(core.runs):
        core.drop(run_id)
    for rid in list(engine.seqs):
        engine.abort(rid)
    assert not core.passes and not core.queue


def _between(trace: list[str]) -> list[int]:
    """Slices between each two consecutive serving steps."""
    counts, n, started = [], 0, False
    for kind in trace:
        if kind in SERVING:
            if started:
                counts.append(n)
            started, n = True, 0
        elif kind == "train":
            n += 1
    return counts


def _turn(loop: EngineCore) -> None:
    """One turn of `EngineCore.run` without its transport: the serving step, then at most one
    training slice."""
    loop.serve()
    loop.train()


def _drive(loop: EngineCore, answers: list, limit: int = 5000) -> list[bool]:
    """Turns until the engine has nothing left (requests done, passes answered); each turn's
    check that a serving step could run and did: [had serving work at its start]."""
    eng, core = loop.engine, trainer_of(loop.engine)
    worked = []
    for _ in range(limit):
        if not eng.has_work() and not core.has_queued:
            return worked
        had = eng.scheduler.has_work
        before = len(loop.trace)
        _turn(loop)
        turn = loop.trace[before:]
        worked.append(had)
        assert turn.count("train") <= 1, turn
        assert not had or (turn and turn[0] in SERVING), f"a turn with serving work ran {turn}"
    raise AssertionError("the engine did not finish")


def test_many_runs_queued_a_decode_step_waits_one_slice_at_most(engine, loop):
    """Eight runs' passes of 8 chunked slices each are queued; a request of the same tenant
    arrives: its decode steps alternate with the slices, one slice between two steps, not eight."""
    core = trainer_of(engine)
    answers = []
    for r in range(8):
        core.create(f"r{r}", RUN)
        answers.append(core.handle("run", [f"r{r}", f"r{r}#0", [_datum(40, r)], "cross_entropy", None, True,
                                           "lab", 1.0, 10]))
    for _ in range(3):  # training under way, no serving
        _turn(loop)
    assert loop.trace == ["train"] * 3
    engine.add_request(_request("chat", "lab", tokens=16))
    _drive(loop, answers)
    assert all(a.done() and a.exception() is None for a in answers)
    trace = loop.trace
    first, last = trace.index("prefill"), len(trace) - 1 - trace[::-1].index("decode")
    assert trace.count("decode") == 15  # 16 tokens: the first from the prefill
    gaps = _between(trace[first:last + 1])
    assert gaps == [1] * 15, trace  # one tenant: its serving and its training alternate


def test_a_light_tenant_runs_before_the_next_slice(engine, loop):
    """Tenants a and b train (8 runs); tenant c's short request arrives between two slices: its
    prefill and all its decode steps run before the next slice (its tokens are fewer than one
    slice's), and the training resumes after."""
    core = trainer_of(engine)
    answers = []
    for r in range(8):
        core.create(f"r{r}", RUN)
        answers.append(core.handle("run", [f"r{r}", f"r{r}#0", [_datum(60, r)] * 2, "cross_entropy", None, True,
                                           "ab"[r % 2], 1.0, 32]))
    for _ in range(4):
        _turn(loop)
    engine.add_request(_request("chat", "c", prompt=6, tokens=16))
    _drive(loop, answers)
    trace = loop.trace
    assert trace[:4] == ["train"] * 4
    served = [i for i, k in enumerate(trace) if k in SERVING]
    assert served == list(range(4, 4 + 16)), trace  # prefill + 15 decodes, back to back
    assert trace[20:] == ["train"] * (len(trace) - 20) and all(a.exception() is None for a in answers)


def test_training_is_charged_and_takes_its_turn(engine, loop, monkeypatch):
    """A long request of tenant c while tenant a trains: slices and c's decode steps alternate
    in the ratio of their tokens (a 10-token forward slice per ten decode tokens), the training
    is not starved, and a's charge is in its virtual time. (Slices run whole here: the quantum
    after which a slice gives way to served sequences is a time, see the test below.)"""
    monkeypatch.setattr(engine_core, "GIVE_WAY_MIN_S", float("inf"))
    core = trainer_of(engine)
    core.create("r", RUN)
    answer = core.handle("run", ["r", "r#0", [_datum(100)], "cross_entropy", None, False, "a", 1.0, 10])
    engine.add_request(_request("long", "c", prompt=4, tokens=120))
    _drive(loop, [answer])
    assert answer.result()["metrics"]["loss:sum"] > 0
    trace = loop.trace
    gaps = _between(trace[trace.index("prefill"):])
    assert max(gaps) <= 1
    # each 10-token slice waits for c to be charged as much: about 10 decode steps per slice
    run_lengths, n = [], 0
    for kind in trace[trace.index("prefill"):]:
        if kind == "train":
            run_lengths.append(n)
            n = 0
        else:
            n += 1
    assert len(run_lengths) >= 5 and all(8 <= k <= 12 for k in run_lengths[1:5]), trace


@pytest.mark.parametrize("quantum", [0.0, float("inf")])
def test_a_slice_gives_way_to_served_sequences_after_its_quantum(engine, loop, monkeypatch, quantum):
    """Tenant c's long request decodes; tenant a's pass is queued and its slice starts in a's
    turn. With a quantum of 0 (EngineCore._give_way: a slice parks at a preemption point once it
    has computed its quantum while sequences are served) the slice parks at every point, and
    c's decode steps and the slice's pieces alternate, one piece between two steps, until the
    slice ends; c's tokens are those it gets alone. With an endless quantum the slice runs whole,
    as before the rule (and as a slice does with nothing being served)."""
    monkeypatch.setattr(engine_core, "GIVE_WAY_MIN_S", quantum)
    monkeypatch.setattr(engine_core, "GIVE_WAY_STEPS", 0.0)
    alone = engine.add_request(_request("solo", "c", prompt=6, tokens=80))  # the same prompt as "chat"
    while engine.has_work():
        engine.step()
    core = trainer_of(engine)
    core.create("r", RUN)
    chat = engine.add_request(_request("chat", "c", prompt=6, tokens=80))
    while len(chat.output_ids) < 20:
        _turn(loop)
    answer = core.handle("run", ["r", "r#0", [_datum(8)], "cross_entropy", None, False, "a", 1.0, 32])
    _drive(loop, [answer])
    assert answer.result()["metrics"]["loss:sum"] > 0 and chat.output_ids == alone.output_ids
    trace = loop.trace
    first = trace.index("train")
    end = next(i for i in range(first, len(trace)) if trace[i] == "train" and trace[i + 1:i + 2] != ["parked"])
    pieces = trace[first:end + 1]
    if quantum == 0.0:
        layers = len(engine.model.model.layers)
        assert pieces.count("parked") >= 2 * layers, pieces  # each layer's attention and MLP at least
        # piece, parked, one serving step, piece, ...: the stream waits for one piece at a time
        assert pieces == ["train", "parked", "decode"] * pieces.count("parked") + ["train"], pieces
    else:
        assert pieces == ["train"] and "parked" not in trace


def test_the_core_process_drains_every_message_yet_runs_one_slice_per_turn(demo_dense):
    """EngineCoreProc takes every message that arrived before its turn (a batch: eight runs' passes
    and a request, as eight SDK clients and a chat send them): the turns it runs still hold one
    serving step and at most one slice each, and every pass is answered."""
    engine = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=128,
                                    torch_threads=1, max_batch_size=8, max_batched_tokens=64))
    ours, theirs = socket.socketpair()
    core = EngineCoreProc(engine, ours)
    core.core.trace = trace = []
    thread = threading.Thread(target=core.serve, daemon=True)
    thread.start()
    try:
        theirs.sendall(encode(Batch(tuple(Train(i, "create", (f"r{i}", RUN, None)) for i in range(8)))))
        returns, finished, messages = {}, False, unpacker()
        theirs.settimeout(60)
        deadline = time.monotonic() + 120
        while len(returns) < 8 and time.monotonic() < deadline:  # the runs exist
            messages.feed(theirs.recv(1 << 16))
            returns.update((msg.call_id, msg.value) for msg in map(decode, messages)
                           if isinstance(msg, Return))
        calls = [Train(100 + i, "run", (f"r{i}", f"p{i}", [_datum(30, i)], "cross_entropy", None,
                                        True, "lab", 1.0, 10)) for i in range(8)]
        calls.append(Add(_request("chat", "lab", tokens=12), None))
        theirs.sendall(encode(Batch(tuple(calls))))
        while not (finished and len(returns) == 16) and time.monotonic() < deadline:
            messages.feed(theirs.recv(1 << 16))
            for msg in map(decode, messages):
                if isinstance(msg, Return):
                    assert msg.error is None, msg
                    returns[msg.call_id] = msg.value
                elif isinstance(msg, Step):
                    finished |= any(out.request_id == "chat" and out.finish_reason is not None
                                    for out in msg.outputs)
        assert len(returns) == 16 and all(returns[100 + i]["metrics"]["loss:sum"] > 0 for i in range(8))
    finally:
        theirs.sendall(encode(Stop()))
        thread.join(30)
        core.close()
        theirs.close()
    first = trace.index("prefill")
    assert trace.count("decode") == 11
    last = len(trace) - 1 - trace[::-1].index("decode")
    assert _between(trace[first:last + 1]) == [1] * 11, trace


# -- the scheduler's part --------------------------------------------------------------------------

def _sched() -> Scheduler:
    return Scheduler(BlockManager(64, 4), max_batch_size=4, max_batched_tokens=64)


def test_a_training_tenant_has_work_and_pays_for_its_slices():
    sched = _sched()
    sched.train_joined("a", 1.0)
    sched.charge("a", 30, 1.0)  # nobody else has work: the charge still counts against a
    assert sched.vtime("a") == 30
    sched.add(Sequence("c0", [1, 2, 3], SamplingParams(max_tokens=2), tenant="c"))
    assert sched.vtime("c") == 30  # c joins at the floor: idling earned it nothing
    assert not sched.training_turn("a", 30, 1.0)  # a, charged 30 more, would be ahead of c
    sched.schedule()  # c's prefill: 3 tokens
    assert sched.vtime("c") == 33 and not sched.training_turn("a", 30, 1.0)
    assert sched.training_turn("a", 3, 1.0)
    assert sched.training_turn("c", 1000, 1.0)  # against its own serving only: its turn
    sched.train_left("a")
    sched.remove(sched.running.first())
    assert sched.vtime("a") == 0 and sched.vtime("c") == 0  # idle: nobody owes anybody


def test_a_training_weight_divides_its_charge():
    sched = _sched()
    sched.train_joined("a", 4.0)
    sched.add(Sequence("c0", [1, 2, 3], SamplingParams(max_tokens=2), tenant="c"))
    sched.schedule()  # c: 3 tokens
    assert sched.training_turn("a", 12, 4.0) and not sched.training_turn("a", 16, 4.0)


# -- generated mixes --------------------------------------------------------------------------------

JOB = st.tuples(st.sampled_from("abc"),                       # tenant
                st.lists(st.integers(2, 30), min_size=1, max_size=3),  # datum lengths
                st.booleans())                                # backward
REQUEST = st.tuples(st.sampled_from("abcd"),                  # tenant ("d" never trains)
                    st.integers(1, 12),                       # prompt tokens
                    st.integers(1, 10),                       # output tokens
                    st.integers(0, 12))                       # the turn it arrives at


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(jobs=st.lists(JOB, min_size=1, max_size=5), requests=st.lists(REQUEST, min_size=1, max_size=5),
       budget=st.integers(3, 24))
def test_any_mix_of_training_and_serving_keeps_the_bound(engine, jobs, requests, budget):
    """Random training jobs (tenants, datum lengths around the slice budget, forward or
    forward_backward) and requests arriving at random turns: every turn runs a serving step
    when there is serving work, at most one slice per turn, so at most one slice between two
    serving steps; every request and every pass ends."""
    loop = EngineCore(engine)
    loop.trace = []
    core = trainer_of(engine)
    answers = []
    try:
        for i, (tenant, lengths, backward) in enumerate(jobs):
            core.create(f"g{i}", RUN)
            answers.append(core.handle("run", [f"g{i}", f"g{i}#0", [_datum(n, i) for n in lengths], "cross_entropy",
                                               None, backward, tenant, 1.0, budget]))
        arrivals = sorted(((turn, i, tenant, prompt, out) for i, (tenant, prompt, out, turn) in enumerate(requests)))
        seqs, turn, events = [], 0, []  # events: the trace, "idle" before a turn without serving work
        for _ in range(5000):
            while arrivals and arrivals[0][0] <= turn:
                _, i, tenant, prompt, out = arrivals.pop(0)
                seqs.append(engine.add_request(_request(f"q{i}", tenant, prompt, out)))
            if not arrivals and not engine.has_work() and not core.has_queued:
                break
            had = engine.scheduler.has_work
            before = len(loop.trace)
            _turn(loop)
            got = loop.trace[before:]
            assert got.count("train") <= 1
            assert not had or (got and got[0] in SERVING), (had, got)
            events += got if had else ["idle", *got]
            turn += 1
        else:
            raise AssertionError("did not finish")
        assert all(a.done() and a.exception() is None for a in answers)
        assert all(s.finish_reason == "length" for s in seqs)
        busy = " ".join(events).split("idle")  # stretches with serving work from turn to turn
        assert all(max(_between(part.split()), default=0) <= 1 for part in busy), events
    finally:
        for run_id in list(core.runs):
            core.drop(run_id)
        for rid in list(engine.seqs):
            engine.abort(rid)


def test_a_pass_whose_caller_went_away_or_whose_run_was_dropped_ends(engine, loop):
    """A queued pass whose caller cancelled its answer is dropped at the next turn, its gradients
    never reaching the run; a dropped run's queued pass is answered 404."""
    core = trainer_of(engine)
    core.create("gone", RUN)
    core.create("dropped", RUN)
    cancelled = core.handle("run", ["gone", "gone#0", [_datum(40)], "cross_entropy", None, True, "a", 1.0, 10])
    dropped = core.handle("run", ["dropped", "dropped#0", [_datum(40)], "cross_entropy", None, True, "a", 1.0, 10])
    _turn(loop)
    assert cancelled.cancel()
    core.drop("dropped")
    assert dropped.exception().status == 404
    _drive(loop, [])
    assert not core.queue and not core.passes and core.runs["gone"].grads is None
    assert engine.scheduler.vtime("a") == 0  # nothing left: nobody owes anybody


def test_a_create_waiting_for_the_optimizer_import_does_not_stop_serving(engine, loop, monkeypatch):
    """A process's first optimizer imports torch._dynamo (seconds): the first create answers
    through a Future once that import, on a thread of its own, is done; the loop serves
    meanwhile, and a bad config is still refused at once."""
    from loraserve.engine.core import training as module
    from loraserve.engine.types import EngineError

    ready, started = threading.Event(), []
    monkeypatch.setattr(module, "_OPTIMIZER_READY", ready)
    monkeypatch.setattr(module, "_warm_optimizer", lambda notify: started.append(notify))
    core = trainer_of(engine)
    with pytest.raises(EngineError) as err:
        core.handle("create", ["bad", {**RUN, "rank": 0}, None])
    assert err.value.status == 400
    answer = core.handle("create", ["late", RUN, None])
    assert started and not answer.done() and not core.has_queued  # nothing for the loop yet
    engine.add_request(_request("chat", "c", tokens=4))
    for _ in range(4):
        _turn(loop)
    assert loop.trace == ["prefill", "decode", "decode", "decode"] and not answer.done()
    ready.set()
    assert core.has_queued and loop.busy
    _turn(loop)
    assert answer.result()["trainable"] > 0 and "late" in core.runs and not core.waiting
