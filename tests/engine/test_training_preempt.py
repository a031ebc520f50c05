"""A training slice gives way to serving part way (train/preempt.py, engine/core/training.py):
the ORDER of the engine's work and what each side computes, never timings.

The slice computes on the trainer thread while the engine's owner thread waits; at each
preemption point (each decoder layer's attention and MLP, forward, recomputation and backward)
it parks when the hosting says input waits (`EngineCore.has_input`). Here the hosting is a list
the test fills: a forward hook on one layer "delivers" a request while the slice runs, the
driver's next turn admits it. What holds: the request's first token comes before the slice ends;
what the pass computes (outputs, gradients, factors after optim_step) is bitwise what it computes
unpreempted; what the request computes is bitwise what it computes alone (the training hooks
and the serving LoRA state do not leak either way); a failure in a preempted slice fails its
passes only; a run dropped or a caller gone while parked ends the slice, nothing else.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch

from loraserve.catalog.store import Catalog
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.engine.core.engine_core import EngineCore
from loraserve.engine.core.process import EngineCoreProc
from loraserve.engine.core.training import trainer_of
from loraserve.engine.messages import encode, Stop
from loraserve.engine.types import GenerateRequest, SamplingParams

RUN = {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}
ADAPTER = "default/served@s1"


def _datum(n: int, salt: int = 0, weight: float = 1.0) -> list:
    toks = [(7 * i + 3 * salt) % 250 + 1 for i in range(n + 1)]
    return [toks[:-1], {"target_tokens": toks[1:], "weights": [weight] * n}]


def _chat(rid: str) -> GenerateRequest:
    """Tenant c's short request on a served adapter (the serving LoRA state is set each step)."""
    return GenerateRequest(rid, [(11 * j) % 250 + 1 for j in range(8)], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0), adapter=ADAPTER, tenant="c")


@pytest.fixture(scope="module")
def engine(demo_dense, tmp_path_factory):
    """The demo base with a catalog holding one trained adapter, paged in (a request on it is
    admitted at once)."""
    root = tmp_path_factory.mktemp("preempt")
    Catalog.create(root / "catalog", shards=2).close()
    eng = build_engine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=512,
                                    torch_threads=1, max_batch_size=8, max_batched_tokens=64,
                                    catalog_dir=str(root / "catalog")))
    core = trainer_of(eng)
    core.create("served", RUN)
    core.begin("served", "s#0", [_datum(16)], "cross_entropy", None, True, "default", 1.0)
    while core.advance("s#0", 64) is None:
        pass
    core.optim_step("served", ADAM)
    blob = core.publish("served", "test", "default/served", "s1")
    eng.adapters.catalog.put_revision("default/served", blob, revision="s1", promote=True, source="test")
    core.drop("served")
    _alone(eng, "warm")
    return eng


def _alone(engine, rid: str):
    seq = engine.add_request(_chat(rid))
    while engine.has_work():
        engine.step()
    return seq


class Driver:
    """An EngineCore over the engine with a hosting of the test's own: `inbox` holds requests
    delivered (from any thread), each turn admits them, then steps; `has_input` is whether any
    wait (or, with `always`, every point)."""

    def __init__(self, engine, always: bool = False):
        self.engine, self.core = engine, trainer_of(engine)
        self.loop = EngineCore(engine)
        self.loop.trace = []
        self.inbox: list[GenerateRequest] = []
        self.seqs: dict[str, object] = {}
        self.loop.has_input = (lambda: True) if always else (lambda: bool(self.inbox))

    def turn(self) -> None:
        while self.inbox:
            req = self.inbox.pop(0)
            self.seqs[req.request_id] = self.engine.add_request(req)
        self.loop.serve()
        self.loop.train()

    def until(self, done, limit: int = 20000) -> None:
        for _ in range(limit):
            if done():
                return
            self.turn()
        raise AssertionError(f"not done: {self.loop.trace[-40:]}")

    def idle(self) -> bool:
        return not self.inbox and not self.engine.has_work() and not self.core.has_queued


def _deliver_at(engine, driver: Driver, layer: int, req: GenerateRequest):
    """A forward hook on `layer`'s MLP that delivers `req` the first time a training forward
    passes it (the slice is under way, past that layer's attention)."""
    fired = []

    def hook(module, args):
        if not torch.is_inference_mode_enabled() and not fired:
            fired.append(True)
            driver.inbox.append(req)
    return engine.model.model.layers[layer].mlp.register_forward_pre_hook(hook)


def _parked_for(core, d: Driver, layer: int, rid: str, call: list):
    """Queue the pass `call` (a `run`'s arguments) with request `rid` delivered in `layer`; its
    answer, once the slice parked for the request and the request is admitted."""
    handle = _deliver_at(core.engine, d, layer, _chat(rid))
    try:
        answer = core.handle("run", call)
        d.until(lambda: core.inflight is not None and rid in d.seqs)
    finally:
        handle.remove()
    return answer


@pytest.fixture()
def clean(engine):
    yield engine
    core = trainer_of(engine)
    assert core.inflight is None and not core.handoff.parked
    for run_id in list(core.runs):
        core.drop(run_id)
    for rid in list(engine.seqs):
        engine.abort(rid)
    assert not core.passes and not core.queue


@pytest.mark.parametrize("budget", [256, 64])  # the datum whole in one slice; in chunks (checkpointed)
def test_a_request_gets_its_first_token_before_the_slice_ends_and_both_compute_as_alone(clean, budget):
    """A 200-token forward_backward is one slice (budget 256) or a chunk per slice (64); a
    request arrives while the slice is in layer 1: the slice parks at the next point, the request
    is prefilled and decoded whole (tenant c is behind), then the slice goes on. The pass's
    outputs, gradients and factors after optim_step are bitwise those of the same pass on an
    identical run unpreempted; the request's tokens and prompt logprobs those it gets alone."""
    engine = clean
    core = trainer_of(engine)
    alone = _alone(engine, "alone")
    for run_id in ("p", "q"):  # identical runs, B moved off zero (their hooks change outputs)
        core.create(run_id, RUN)
        core.begin(run_id, f"{run_id}#0", [_datum(24, 1)], "cross_entropy", None, True, "a", 1.0)
        while core.advance(f"{run_id}#0", 64) is None:
            pass
        core.optim_step(run_id, ADAM)

    d = Driver(engine)
    handle = _deliver_at(engine, d, 1, _chat("chat"))
    try:
        answer = core.handle("run", ["p", "p#1", [_datum(200, 2)], "cross_entropy", None, True, "a", 1.0, budget])
        d.until(lambda: "chat" in d.seqs)  # the turn that parked, then the one that admits it
        chat = d.seqs["chat"]
        d.until(lambda: bool(chat.output_ids))
        assert not answer.done()  # the first token came while the slice was parked
        d.until(d.idle)
    finally:
        handle.remove()
    trace = d.loop.trace
    first = trace.index("prefill")
    assert trace[first - 2:first] == ["train", "parked"]
    assert trace[first:first + 12] == ["prefill"] + ["decode"] * 11  # whole, before the slice goes on
    assert "train" in trace[first + 12:]
    assert chat.output_ids == alone.output_ids
    assert [lp.logprob for lp in chat.prompt_logprobs[1:]] == [lp.logprob for lp in alone.prompt_logprobs[1:]]

    unpreempted = Driver(engine)
    reference = core.handle("run", ["q", "q#1", [_datum(200, 2)], "cross_entropy", None, True, "a", 1.0, budget])
    unpreempted.until(unpreempted.idle)
    assert "parked" not in unpreempted.loop.trace
    assert answer.result() == reference.result()  # outputs and loss, as lists: bitwise
    for g, h in zip(core.runs["p"].grads, core.runs["q"].grads):
        assert torch.equal(g, h)
    core.optim_step("p", ADAM)
    core.optim_step("q", ADAM)
    for a, b in zip(core.runs["p"].factors.parameters(), core.runs["q"].factors.parameters()):
        assert torch.equal(a, b)


def test_parked_at_every_point_the_pass_is_unchanged(clean):
    """A hosting that always has input: the slice parks at every point (forward, recomputation
    of each checkpointed layer, backward), each turn moving it one piece; the pass computes what
    it computes unpreempted."""
    engine = clean
    core = trainer_of(engine)
    for run_id in ("p", "q"):
        core.create(run_id, RUN)
    parks = core.handoff.parks
    d = Driver(engine, always=True)
    answer = core.handle("run", ["p", "p#0", [_datum(90, 3)], "cross_entropy", None, True, "a", 1.0, 30])
    d.until(d.idle)
    assert core.handoff.parks - parks == d.loop.trace.count("parked")
    # 3 forward chunks of 30 tokens and 9 backward chunks of 10, each parked at its points: 13
    # in a forward (4 layers, their attention and MLP, the unembedding), as many again in a
    # backward chunk's recomputation and in its backward
    assert d.loop.trace.count("parked") > 13 * 3 + 13 * 9
    reference = core.handle("run", ["q", "q#0", [_datum(90, 3)], "cross_entropy", None, True, "a", 1.0, 30])
    Driver(engine).until(lambda: reference.done())
    assert answer.result() == reference.result()
    for g, h in zip(core.runs["p"].grads, core.runs["q"].grads):
        assert torch.equal(g, h)


def test_a_failure_in_a_preempted_slice_fails_its_passes_only(clean):
    """Two runs share a slice that parks for a request. One run's loss is not finite: its pass
    fails with a 400, the other's stands, and the request is served whole. Then a slice that
    raises after it parked (a fault in the forward): its passes fail, the request is served,
    and the next pass of the same runs trains."""
    engine = clean
    core = trainer_of(engine)
    core.create("good", RUN)
    core.create("bad", RUN)
    d = Driver(engine)
    handle = _deliver_at(engine, d, 0, _chat("chat1"))
    try:
        good = core.handle("run", ["good", "g#0", [_datum(60, 4)], "cross_entropy", None, True, "a", 1.0, 256])
        bad = core.handle("run", ["bad", "b#0", [_datum(60, 5, weight=float("nan"))], "cross_entropy", None,
                                  True, "b", 1.0, 256])
        d.until(d.idle)
    finally:
        handle.remove()
    assert "parked" in d.loop.trace and d.seqs["chat1"].finish_reason == "length"
    assert good.result()["metrics"]["loss:sum"] > 0 and core.runs["good"].grads is not None
    assert bad.exception().status == 400 and core.runs["bad"].grads is None

    d = Driver(engine)
    faults = []

    def fault(module, args):  # after the request came: the slice resumed, then it breaks
        if not torch.is_inference_mode_enabled() and d.seqs.get("chat2") is not None and not faults:
            faults.append(True)
            raise RuntimeError("a fault in the training forward")
    handles = [_deliver_at(engine, d, 0, _chat("chat2")),
               engine.model.model.layers[2].self_attn.register_forward_pre_hook(fault)]
    try:
        broken = [core.handle("run", [r, f"{r}#1", [_datum(60, 6)], "cross_entropy", None, True, "a", 1.0, 256])
                  for r in ("good", "bad")]
        d.until(d.idle)
    finally:
        for h in handles:
            h.remove()
    assert faults and d.seqs["chat2"].finish_reason == "length"
    assert all("a fault in the training forward" in str(b.exception()) for b in broken)
    again = core.handle("run", ["bad", "b#2", [_datum(60, 6)], "cross_entropy", None, True, "a", 1.0, 256])
    Driver(engine).until(lambda: again.done())
    assert again.result()["metrics"]["loss:sum"] > 0


def test_a_run_dropped_or_a_caller_gone_while_parked_ends_the_slice(clean):
    """While its slice is parked for a request: the run dropped -> its caller gets a 404 and the
    slice is abandoned (the trainer thread is free, nothing charged); a caller that cancelled ->
    its pass ends at the next turn, no gradients reach the run. The request is served whole
    each time, and a pass after trains."""
    engine = clean
    core = trainer_of(engine)
    for run_id in ("dropped", "gone", "next"):
        core.create(run_id, RUN)
    d = Driver(engine)
    dropped = _parked_for(core, d, 1, "chat1", ["dropped", "d#0", [_datum(200, 7)], "cross_entropy", None, True,
                                                 "a", 1.0, 256])
    core.handle("drop", ["dropped"])
    assert dropped.exception().status == 404
    assert core.inflight is None and not core.handoff.parked
    d.until(d.idle)
    assert d.seqs["chat1"].finish_reason == "length" and engine.scheduler.vtime("a") == 0

    gone = _parked_for(core, d, 1, "chat2", ["gone", "g#0", [_datum(200, 8)], "cross_entropy", None, True,
                                             "a", 1.0, 64])
    assert gone.cancel()
    d.until(d.idle)
    assert core.inflight is None and core.runs["gone"].grads is None
    assert d.seqs["chat2"].finish_reason == "length"
    after = core.handle("run", ["next", "n#0", [_datum(40, 9)], "cross_entropy", None, True, "a", 1.0, 256])
    d.until(lambda: after.done())
    assert after.result()["metrics"]["loss:sum"] > 0


def test_an_optim_step_of_a_run_in_the_parked_slice_lets_it_finish_first(clean):
    """An operation that would change what a parked slice computes with (the run's optim_step)
    finishes the slice first: the step applies to the pass's gradients, as in order."""
    engine = clean
    core = trainer_of(engine)
    core.create("r", RUN)
    d = Driver(engine)
    answer = _parked_for(core, d, 1, "chat", ["r", "r#0", [_datum(120, 10)], "cross_entropy", None, True,
                                              "a", 1.0, 256])
    assert core.handle("optim_step", ["r", ADAM])["steps"] == 1
    assert answer.result()["metrics"]["loss:sum"] > 0 and core.inflight is None
    d.until(d.idle)


def test_in_process_a_chat_is_answered_before_the_pass_it_arrived_during(demo_dense):
    """AsyncEngine: the engine thread's inbox is the input the slice gives way to. A chat sent
    while a one-slice pass runs (its Add is in the inbox before the slice passes layer 1) gets
    its first token before the pass is answered."""
    eng = AsyncEngine.from_config(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                               max_model_len=512, torch_threads=1, train_max_tokens=512))
    eng.transport.core.trace = trace = []
    events: list[str] = []

    async def main():
        await eng.start()
        await eng.trainer.create("r", RUN)
        loop = asyncio.get_running_loop()
        fired = threading.Event()

        async def chat():
            req = GenerateRequest("chat", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                  tenant="c")
            async for out in eng.generate(req):
                if out.token_ids and "first token" not in events:
                    events.append("first token")

        def hook(module, args):  # the trainer thread, inside the slice
            if not torch.is_inference_mode_enabled() and not fired.is_set():
                fired.set()
                asyncio.run_coroutine_threadsafe(asyncio.wait_for(started(), 30), loop)
                deadline = time.monotonic() + 30
                while eng.transport._inbox.empty() and time.monotonic() < deadline:
                    time.sleep(0.001)

        tasks = []

        async def started():
            tasks.append(asyncio.ensure_future(chat()))

        handle = eng.transport.engine.model.model.layers[1].register_forward_pre_hook(hook)
        try:
            await eng.trainer.run_pass("r", [_datum(300, 11)], "cross_entropy", None, True, "a")
            events.append("pass answered")
            await asyncio.gather(*tasks)
        finally:
            handle.remove()
            await eng.shutdown()

    asyncio.run(main())
    assert events == ["first token", "pass answered"]
    assert "parked" in trace and trace.index("parked") < trace.index("prefill")


def test_the_core_process_sees_a_frame_or_a_wake_up_waiting(demo_dense):
    """EngineCoreProc's `has_input`: nothing waiting -> False; a frame on the socket or a wake-up
    -> True (what a slice on the trainer thread asks at its points); output the socket did not
    take -> True once the socket can take some (a turn sends it), False while it cannot."""
    from loraserve.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=64,
                                    torch_threads=1))
    ours, theirs = socket.socketpair()
    proc = EngineCoreProc(engine, ours)
    try:
        assert not proc.core.has_input()
        theirs.sendall(encode(Stop()))
        assert proc.core.has_input()
        proc._receive()
        assert not proc.core.has_input()
        proc._wake()
        assert proc.core.has_input()
        proc._take(0)  # the turn drains the wake-up
        assert not proc.core.has_input()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        proc._write(bytes(4 << 20))  # a save's blob, far more than the socket takes
        assert proc._unsent and not proc.core.has_input()  # full: nothing a turn could do
        theirs.setblocking(False)
        while len(theirs.recv(1 << 20)) == 1 << 20:
            pass
        assert proc.core.has_input()  # the reader took some: a turn sends more
        while proc._unsent:
            proc._take(0)
            with contextlib.suppress(BlockingIOError):
                while theirs.recv(1 << 20):
                    pass
        assert not proc.core.has_input()
    finally:
        proc.close()
        theirs.close()
