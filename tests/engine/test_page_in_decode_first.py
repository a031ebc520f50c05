"""A step right after page-ins were asked for decodes the running sequences first, without
waiting for the reads; the reads land during that step, and the next step admits their requests
in one prefill. It used to wait up to PAGE_IN_GRACE_S for them, holding the engine thread (which
sets the server's rate) idle: 9-20% of its time on a cold workload (bench/RESULTS.md, session
19). A prompt is never put off by more than one decode step in a row, and a step with nothing
to decode waits for the reads as before."""
from __future__ import annotations

import pytest

from loraserve.demo import build_demo
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.engine.types import GenerateRequest, SamplingParams

LONG = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo(tmp_path_factory.mktemp("decode-first") / "demo")


@pytest.fixture
def engine(demo):
    """A fresh engine (its CPU tier empty: every demo adapter is cold), its steps and waits
    recorded: `engine.kinds` [(prefill or decode, request ids)], `engine.waits` [timeout]."""
    eng = build_engine(EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), device="cpu",
                                    max_model_len=64, torch_threads=1, compile="off"))
    eng.kinds, eng.waits = [], []
    run, wait = eng.runner.run, eng.adapters.wait_reads

    def recording_run(seqs, is_prefill):
        eng.kinds.append(("prefill" if is_prefill else "decode", [s.request_id for s in seqs]))
        return run(seqs, is_prefill)

    def recording_wait(timeout):
        eng.waits.append(timeout)
        return wait(timeout)

    eng.runner.run, eng.adapters.wait_reads = recording_run, recording_wait
    yield eng
    eng.adapters.close()


def _add(engine, rid: str, adapter: str | None = None) -> None:
    engine.add_request(GenerateRequest(rid, [1, 2, 3], LONG, adapter))


def _running_base(engine) -> None:
    _add(engine, "base")
    engine.step()  # its prefill: now it decodes
    assert engine.kinds == [("prefill", ["base"])]
    engine.kinds.clear()


def test_a_step_after_a_page_in_was_asked_decodes_first_and_does_not_wait(engine) -> None:
    _running_base(engine)
    _add(engine, "cold", "demo/pirate")
    assert engine.scheduler.parked
    engine.step()
    assert engine.kinds == [("decode", ["base"])] and engine.waits == []
    assert engine.adapters.pager.wait_reads(30)  # (here: as if that step had taken as long)
    engine.step()
    assert engine.kinds[-1] == ("prefill", ["cold"])  # admitted the step after, at once
    assert engine.waits == []


def test_a_prompt_is_put_off_by_one_decode_step_at_most(engine) -> None:
    _running_base(engine)
    _add(engine, "cold-1", "demo/pirate")
    engine.step()
    assert engine.kinds == [("decode", ["base"])]
    _add(engine, "cold-2", "demo/robot")  # page-ins asked again before the next step
    _add(engine, "warm", None)  # and a prompt that needs none
    engine.step()
    assert engine.waits == [pytest.approx(0.005)]  # this one waited for the reads, as before
    kind, ids = engine.kinds[1]
    assert kind == "prefill" and "warm" in ids  # (the cold ones too once read: timing)


def test_a_step_with_nothing_to_decode_waits_for_the_reads(engine) -> None:
    _add(engine, "cold", "demo/pirate")
    engine.step()
    assert engine.waits == [pytest.approx(0.005)]
    while not engine.kinds:
        engine.step()
    assert engine.kinds[0] == ("prefill", ["cold"])
