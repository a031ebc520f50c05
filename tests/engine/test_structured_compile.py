"""Grammar compiles off the engine's critical path (issue 23): the xgrammar tokenizer info is
built when the engine is, a compile runs on the grammar workers once per key however many
requests ask, a compile that does not end within the bound is a 400 naming the field, and the
engine keeps stepping other requests while one request's grammar compiles (the single-process
AsyncEngine and the engine-core process both admit that request once its grammar is compiled).

A compile is held back by a gate (an Event the test sets), so what runs while it compiles is
decided by the test, not by timing."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator

import pytest

from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.engine_core import EngineCore
from loraserve.engine.core.structured import GrammarEngine
from loraserve.engine.types import EngineError, GenerateRequest, GrammarSpec, SamplingParams
from loraserve.engine.messages import Abort, Add

DIGITS = GrammarSpec("regex", "[0-9]{3}", "guided_regex")


def _engine(demo_dense) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32",
                                  max_model_len=128))


def _gate(grammars: GrammarEngine, fail: bool = False) -> threading.Event:
    """Hold every compile of `grammars` until the returned event is set (then fail it, with
    `fail`, as a grammar that does not compile would)."""
    gate, real = threading.Event(), grammars._compile

    def held(spec: GrammarSpec):
        gate.wait()
        if fail:
            raise EngineError(f"{spec.param}: does not compile", param=spec.param)
        return real(spec)

    grammars._compile = held
    return gate


@pytest.fixture(scope="module")
def engine(demo_dense) -> LLMEngine:
    return _engine(demo_dense)


def test_tokenizer_info_is_built_with_the_engine(engine: LLMEngine) -> None:
    """No request has asked for a grammar, and the tokenizer info is there."""
    assert engine.grammars.compiles == 0
    assert engine.grammars.info.vocab_size == engine.vocab_size


def test_one_compile_per_key_and_a_compile_past_the_bound_is_a_400(engine: LLMEngine) -> None:
    g = GrammarEngine(engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids,
                      compile_timeout_s=0.05)
    gate = _gate(g)
    first = g.prepare(DIGITS)
    assert g.prepare(DIGITS) is first and not first.done()
    with pytest.raises(EngineError) as err:
        g.compile(DIGITS)
    assert err.value.param == "guided_regex" and "did not compile within" in str(err.value)
    gate.set()
    compiled = first.result(timeout=60)
    assert g.compile(DIGITS) is compiled and g.compiles == 1  # cached by kind and text
    g.close()


async def _collect(engine: AsyncEngine, req: GenerateRequest) -> str:
    return "".join([out.text async for out in engine.generate(req)])


def test_async_engine_steps_others_while_a_grammar_compiles(demo_dense) -> None:
    eng = AsyncEngine(_engine(demo_dense))
    prompt = eng.tokenizer.encode("Count:")
    gate = _gate(eng.transport.engine.grammars)
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def main() -> tuple[str, str]:
        try:
            held = asyncio.create_task(_collect(eng, GenerateRequest(
                "c", prompt, SamplingParams(max_tokens=8, temperature=0, structured=DIGITS))))
            text = await _collect(eng, GenerateRequest("f", prompt, free))
            assert not held.done()  # the free request finished while the grammar compiled
            gate.set()
            return text, await held
        finally:
            await eng.shutdown()

    free_text, digits = asyncio.run(main())
    assert len(free_text) > 0 and re.fullmatch("[0-9]{3}", digits)


def test_async_engine_fails_alone_a_grammar_that_does_not_compile(demo_dense) -> None:
    eng = AsyncEngine(_engine(demo_dense))
    _gate(eng.transport.engine.grammars, fail=True).set()
    req = GenerateRequest("c", eng.tokenizer.encode("x"), SamplingParams(
        max_tokens=4, structured=GrammarSpec("regex", "[a-z]+", "guided_regex")))

    async def main() -> None:
        try:
            with pytest.raises(EngineError) as err:
                await _collect(eng, req)
            assert err.value.param == "guided_regex"
        finally:
            await eng.shutdown()

    asyncio.run(main())


@pytest.fixture()
def core(demo_dense) -> Iterator[EngineCore]:
    core = EngineCore(_engine(demo_dense))
    yield core
    core.close()


def _add(core: EngineCore, request_id: str, params: SamplingParams) -> list:
    req = GenerateRequest(request_id, [1, 2, 3], params)
    return core.handle(Add(req, None))


def test_engine_core_admits_a_request_once_its_grammar_is_compiled(core: EngineCore) -> None:
    gate = _gate(core.engine.grammars)
    assert _add(core, "c", SamplingParams(max_tokens=4, structured=DIGITS)) == []
    _add(core, "f", SamplingParams(max_tokens=4, ignore_eos=True))
    core.serve()  # steps the free request; the constrained one is not in the engine yet
    assert "f" in core.engine.seqs and "c" not in core.engine.seqs
    assert core.admit_compiled() == []  # still compiling
    gate.set()
    core.engine.grammars.prepare(DIGITS).result(timeout=60)
    core.admit_compiled()
    assert "c" in core.engine.seqs and not core.compiling


def test_engine_core_abort_or_timeout_while_compiling(core: EngineCore) -> None:
    gate = _gate(core.engine.grammars)
    _add(core, "gone", SamplingParams(max_tokens=4, structured=DIGITS))
    core.handle(Abort("gone"))
    assert not core.compiling  # aborted before it reached the engine
    core.engine.grammars.compile_timeout_s = 0.0
    _add(core, "late", SamplingParams(max_tokens=4, structured=DIGITS))
    # the bound counts from when the grammar engine was ready (its tokenizer info built on a
    # thread): on a busy machine that may come after the add, so wait for the bound to pass
    deadline, outs = time.monotonic() + 60, []
    while not outs and time.monotonic() < deadline:
        outs = core.admit_compiled()
        time.sleep(0.01)
    [failed] = outs
    assert failed.finish_reason == "error" and failed.error.param == "guided_regex"
    gate.set()


def test_async_engine_drops_a_request_aborted_while_its_grammar_compiles(demo_dense) -> None:
    eng = AsyncEngine(_engine(demo_dense))
    gate = _gate(eng.transport.engine.grammars)
    req = GenerateRequest("gone", eng.tokenizer.encode("x"),
                          SamplingParams(max_tokens=4, structured=DIGITS))

    added, add = [], eng.transport.engine.add_sequence  # what reaches the engine
    eng.transport.engine.add_sequence = lambda seq, *rest: (added.append(seq.request_id), add(seq, *rest))[1]

    async def main() -> None:
        try:
            task = asyncio.create_task(_collect(eng, req))
            while "gone" not in eng.transport.core.compiling:
                await asyncio.sleep(0.01)  # the engine thread has it as compiling
            task.cancel()  # the client leaves: the request is aborted
            with pytest.raises(asyncio.CancelledError):
                await task
            while "gone" in eng.transport.core.compiling:
                await asyncio.sleep(0.01)  # the abort reached the engine thread
            gate.set()
            assert await asyncio.to_thread(eng.transport.engine.grammars.prepare(DIGITS).result, 60)
            # the same grammar, compiled now: the next request runs, and the aborted one never did
            assert await _collect(eng, GenerateRequest("next", req.prompt_token_ids, req.params))
            assert added == ["next"] and not eng.transport.core.compiling
        finally:
            await eng.shutdown()

    asyncio.run(main())


def test_async_engine_fails_a_request_whose_grammar_compiles_past_the_bound(demo_dense) -> None:
    eng = AsyncEngine(_engine(demo_dense))
    gate = _gate(eng.transport.engine.grammars)
    eng.transport.engine.grammars.compile_timeout_s = 0.05
    req = GenerateRequest("late", eng.tokenizer.encode("x"),
                          SamplingParams(max_tokens=4, structured=DIGITS))

    async def main() -> None:
        try:
            with pytest.raises(EngineError) as err:
                await _collect(eng, req)
            assert err.value.param == "guided_regex" and "within" in str(err.value)
        finally:
            gate.set()
            await eng.shutdown()

    asyncio.run(main())


def test_the_bound_counts_from_the_tokenizer_info_not_before_it(engine: LLMEngine,
                                                                monkeypatch) -> None:
    """The engine's one-time tokenizer setup (slow on a busy host) does not count against the
    requests that arrive during it: their bound starts once it is built."""
    gate, real = threading.Event(), GrammarEngine._new_compiler

    def held(*args):
        gate.wait()
        return real(*args)

    monkeypatch.setattr(GrammarEngine, "_new_compiler", staticmethod(held))
    g = GrammarEngine(engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids,
                      compile_timeout_s=0.2)
    since, started = 0.0, threading.Event()  # a request waiting since long ago
    g.when_ready(started.set)
    assert not g.late(since) and not started.is_set()  # setup under way: nobody is late
    gate.set()
    assert started.wait(60)
    assert not g.late(since)  # the bound starts now
    threading.Event().wait(0.3)
    assert g.late(since)
    g.close()
