"""The resume state is written off the training thread: a snapshot taken at the step (later
in-place updates do not reach it), the newest of several pending states only, by an atomic
rename (a failed write leaves the previous file whole); the engine core writes it after each
optim_step and load_state, with the step count the API side compares after a restart."""
from __future__ import annotations

import threading

import safetensors.torch
import torch

from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.training import TrainerCore
from loraserve.train.resume import ResumeWriter, snapshot, write_atomic

from .test_hosting import ADAM, RUN, _cfg, _data


def test_snapshot_is_not_reached_by_in_place_updates():
    t = torch.ones(3)
    snap = snapshot({"a": t})
    t.add_(1)
    assert torch.equal(snap["a"], torch.ones(3))


def test_pending_states_of_a_path_coalesce_to_the_newest(tmp_path, monkeypatch):
    writer, entered, gate, paths = ResumeWriter(), threading.Event(), threading.Event(), []
    real = write_atomic

    def slow(path, blob):  # the first write holds the writer while three more states queue
        entered.set()
        gate.wait(10)
        paths.append(path)
        real(path, blob)

    monkeypatch.setattr("loraserve.train.resume.write_atomic", slow)
    a, b = tmp_path / "a.state", tmp_path / "b.state"
    writer.put(a, {"x": torch.zeros(2)}, {"steps": "1"})
    assert entered.wait(10)
    for step in (2, 3, 4):
        writer.put(a if step != 3 else b, {"x": torch.full((2,), float(step))}, {"steps": str(step)})
    gate.set()
    writer.flush()
    assert sorted(p.name for p in paths) == ["a.state", "a.state", "b.state"]  # step 2 superseded by 4
    assert torch.equal(safetensors.torch.load_file(a)["x"], torch.full((2,), 4.0))
    assert writer._thread is None  # nothing pending: no thread left


def test_a_failed_write_leaves_the_previous_state(tmp_path, monkeypatch):
    path = tmp_path / "r" / "resume.state"
    write_atomic(path, safetensors.torch.save({"x": torch.ones(2)}))

    def broken(self, data):  # the disk fills mid-write
        raise OSError("no space left on device")

    monkeypatch.setattr("pathlib.Path.write_bytes", broken)
    writer = ResumeWriter()
    writer.put(path, {"x": torch.zeros(2)}, {})
    writer.flush()
    monkeypatch.undo()
    assert torch.equal(safetensors.torch.load_file(path)["x"], torch.ones(2)) and writer.written == 0


def test_the_core_writes_each_step_behind_its_answer(demo_dense, tmp_path):
    core = TrainerCore(LLMEngine(_cfg(demo_dense)))
    path = tmp_path / "t" / "r" / "resume.state"
    core.create("r", RUN, str(path))
    for step in (1, 2):
        core.begin("r", "p", _data(1, 6), "cross_entropy", None, True, "default", 1.0)
        while core.advance("p", 64) is None:
            pass
        assert core.optim_step("r", ADAM)["steps"] == step
    core.writer.flush()
    blob, want = path.read_bytes(), core.state_blob("r")  # the state after step 2, as save_weights takes it
    got, expected = safetensors.torch.load(blob), safetensors.torch.load(want)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    core.create("r2", RUN)
    assert core.load_state("r2", blob, True, keep=False) == 2
