"""The engine-core process starts its heartbeat before it imports torch (engine.core.boot); what
it imports before that must stay light, or a loaded machine sees a core 'stalled while
starting'. The spawned process unpickles its arguments (an EngineConfig) first, so
engine.config counts too."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "safetensors", "lmdb", "loraserve.catalog.importer")


@pytest.mark.parametrize("module", ["loraserve.engine.config", "loraserve.engine.core.boot",
                                    "loraserve.engine.heartbeat"])
def test_the_core_boot_path_imports_nothing_heavy(module: str) -> None:
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"
