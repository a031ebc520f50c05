"""The training state dir (issue 43, low: it stayed in /tmp after exit): a temporary one the
server made is removed when it stops; one the operator named (`--train-state-dir`) is kept."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from loraserve.server import build_app
from .fake_engine import FakeEngine
from .live import LiveServer


def test_a_temporary_state_dir_is_removed_at_exit() -> None:
    app = build_app(FakeEngine())
    state_dir = app.state.tinker.runs.state_dir
    (state_dir / "run-1").mkdir()
    (state_dir / "run-1" / "adam.safetensors").write_bytes(b"x")
    with LiveServer(app):
        assert state_dir.is_dir()
    assert not state_dir.exists()


def test_a_named_state_dir_is_kept(tmp_path: Path) -> None:
    engine = FakeEngine(config=SimpleNamespace(train_state_dir=str(tmp_path / "state")))
    (tmp_path / "state").mkdir()
    app = build_app(engine)
    with LiveServer(app):
        pass
    assert (tmp_path / "state").is_dir()
