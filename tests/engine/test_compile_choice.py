"""`--compile auto` on the CPU remembers each batch bucket's measured choice (compiled or eager)
per base shape and machine, and skips compiling when eager won everywhere
(engine.core.decode_graphs.choice_key / read_choice / write_choice, engine.core.build)."""
from __future__ import annotations

import dataclasses
import json

import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.core import build
from loraserve.engine.core import decode_graphs
from loraserve.engine.core.decode_graphs import choice_key, read_choice, write_choice
from loraserve.model.tiny import tiny_config


class _Measured:
    """What `write_choice` reads of a DecodeGraphs after `choose`."""
    eager_batches = {1, 2}
    timings = {1: (0.010, 0.012), 2: (0.011, 0.013), 4: (0.02, 0.015)}


def test_choice_round_trips_and_is_keyed_by_what_it_depends_on(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "choices.json"
    cfg = tiny_config()
    key = choice_key(cfg, torch.float32, (1, 2, 4), packed=True)
    assert read_choice(path, key) is None
    write_choice(path, key, _Measured())
    assert read_choice(path, key) == {1, 2}
    assert json.loads(path.read_text())[key]["ms"]["4"] == [20.0, 15.0]
    others = [choice_key(cfg, torch.bfloat16, (1, 2, 4), packed=True),
              choice_key(cfg, torch.float32, (1, 2), packed=True),
              choice_key(cfg, torch.float32, (1, 2, 4), packed=False),
              choice_key(dataclasses.replace(cfg, hidden_size=256), torch.float32, (1, 2, 4), packed=True)]
    assert len({key, *others}) == 5 and all(read_choice(path, k) is None for k in others)
    # another release of the step's code (model, kernels, LoRA, attention): measured again
    monkeypatch.setattr(decode_graphs, "_SIGNATURE", ["another release"])
    assert read_choice(path, choice_key(cfg, torch.float32, (1, 2, 4), packed=True)) is None
    path.write_text("not json")
    assert read_choice(path, key) is None  # a damaged file means measuring again


def test_auto_skips_compiling_where_eager_won_every_bucket(tmp_path, monkeypatch, demo_dense):
    cache = tmp_path / "choices.json"
    monkeypatch.setenv("LORASERVE_COMPILE_CACHE", str(cache))
    cfg = EngineConfig(model_dir=str(demo_dense), max_model_len=64, max_batch_size=4,
                       compile="off", compile_batch_sizes=[1, 4])
    engine = build.build_engine(cfg)
    auto = dataclasses.replace(cfg, compile="auto")
    packed = any(isinstance(m, build.PackedLinear) for m in engine.model.modules())
    key = choice_key(engine.model_config, engine.dtype, (1, 4), packed)

    class _EagerEverywhere(_Measured):
        eager_batches = {1, 4}
        timings = {}

    write_choice(cache, key, _EagerEverywhere())
    made = []
    monkeypatch.setattr(build, "DecodeGraphs", lambda *a, **k: made.append(a))
    assert build._compile_decode(engine, auto) is None
    assert made == []  # nothing compiled
