"""A training run survives a restart of the engine core it lives in: after each optim_step the
server keeps the run's state (factors, Adam moments, step) in --train-state-dir, and the first
call after the core restarted puts the run back as it was after its last step. Gradients of a
step in progress when the core died are lost, and so are steps whose state the core had not yet
written (it writes behind each step's answer): the next optim_step says so instead of stepping
without them. The real SDK against a server with an engine-core process, killed by the test."""
from __future__ import annotations

import os
import signal
import time

import mint
import pytest
import safetensors
import torch
from mint import types

from loraserve.catalog.ids import DEFAULT_TENANT
from loraserve.engine.client.core_client import CoreClient
from loraserve.engine.config import EngineConfig
from loraserve.model.loader import load_model
from loraserve.server import build_app
from loraserve.train.config import RunConfig
from loraserve.train.run import AdamParams, Datum, TrainingRun

from .live import LiveServer
from .test_tinker_sdk import demo  # noqa: F401  (the shared demo build, a fixture)

LR = 1e-2
TOKENS = [(5 * i) % 200 + 3 for i in range(25)]


def _datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


def _local_loss(model_dir, steps: int) -> float:
    """The loss of the same run's forward_backward after `steps` steps, computed here."""
    run = TrainingRun(load_model(model_dir), RunConfig(rank=4, seed=0))
    datum = Datum(torch.tensor(TOKENS[:-1]), {"target_tokens": torch.tensor(TOKENS[1:]),
                                              "weights": torch.ones(len(TOKENS) - 1)})
    for _ in range(steps + 1):
        p = run.start([datum], "cross_entropy")
        p.advance(10_000)
        loss = p.finish().metrics["loss:sum"]
        run.optim_step(AdamParams(learning_rate=LR))
    return loss


def _steps_of(path) -> int:
    return int(safetensors.safe_open(path, "pt").metadata()["steps"])


def _state_after(path, steps: int) -> bytes:
    """The resume file's bytes once it holds the state after `steps` steps (written behind)."""
    deadline = time.monotonic() + 60
    while not (path.is_file() and _steps_of(path) == steps):
        assert time.monotonic() < deadline, "the resume state was not written"
        time.sleep(0.05)
    return path.read_bytes()


def _kill_core(engine: CoreClient) -> None:
    first = engine.core_pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (engine.ready and engine.core_pid not in (None, first)):
        assert time.monotonic() < deadline, "the engine core did not come back"
        time.sleep(0.1)


def test_a_run_continues_after_its_engine_core_restarts(demo, tmp_path):  # noqa: F811
    cfg = EngineConfig(model_dir=str(demo.qwen3), device="cpu", max_model_len=128, torch_threads=1,
                       train_state_dir=str(tmp_path / "state"))
    engine = CoreClient(cfg)
    with LiveServer(build_app(engine)) as live:
        trainer = mint.ServiceClient(base_url=live.url, api_key="tml-test").create_lora_training_client(
            base_model="qwen3", rank=4, seed=0)
        resume = tmp_path / "state" / DEFAULT_TENANT / trainer.model_id / "resume.state"
        for step in (1, 2):
            trainer.forward_backward([_datum()], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=LR)).result()
            after = _state_after(resume, step)
            if step == 1:
                after_first = after
        trainer.forward_backward([_datum()], "cross_entropy").result()  # a step in progress
        resume.write_bytes(after_first)  # as if the core died before it wrote step 2's state
        _kill_core(engine)
        with pytest.raises(Exception, match="gradients of its forward_backward calls since the last "
                                            "optim_step were lost; steps 2-2 were lost, their state "
                                            r"not yet written \(the run is as after step 1\)"):
            trainer.optim_step(types.AdamParams(learning_rate=LR)).result()
        again = trainer.forward_backward([_datum()], "cross_entropy").result().metrics["loss:sum"]
        trainer.optim_step(types.AdamParams(learning_rate=LR)).result()
        assert engine.restarts == 1
    assert again == pytest.approx(_local_loss(demo.qwen3, 1), rel=1e-5)  # as after its 1st step
    assert after != after_first
