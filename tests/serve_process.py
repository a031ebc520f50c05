"""`loraserve serve` as an operator runs it: a subprocess on the tiny demo base with a catalog of
three hand-written adapters, its stdout and stderr read to their end (EOF: every process that
holds them has closed them, children included), stopped with SIGINT as Ctrl-C stops it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from loraserve.cli_catalog import run as catalog_cli
from loraserve.demo import build_demo_base

from server.adapter_files import write_peft

ADAPTERS = ("acme/a", "acme/b", "acme/c")


def build_served(root: Path) -> tuple[Path, Path]:
    """(base dir, catalog dir): the tiny qwen3 base and a catalog holding ADAPTERS."""
    base = build_demo_base(root / "qwen3")
    catalog = root / "catalog"
    assert catalog_cli(["catalog", "init", str(catalog)]) == 0
    for i, ref in enumerate(ADAPTERS):
        peft = write_peft(root / f"peft-{i}", base, seed=i)
        assert catalog_cli(["catalog", "import", str(catalog), ref, str(peft), "--model",
                            str(base)]) == 0
    return base, catalog


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`loraserve serve --model BASE --catalog CAT ARGS` on a free port (`serve BASE`, as vLLM
    takes it, when `positional`; no --catalog when `catalog` is None); `lines` holds what it
    wrote, per stream, once `stop` has returned."""

    def __init__(self, base: Path, catalog: Path | None, *args: str, ready_s: float = 300.0,
                 positional: bool = False) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = [str(base)] if positional else ["--model", str(base)]
        cat = [] if catalog is None else ["--catalog", str(catalog)]
        cmd = [sys.executable, "-m", "loraserve.cli", "serve", *model, *cat, "--port",
               str(self.port), "--device", "cpu", "--max-model-len", "96", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     start_new_session=True)
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                         for name, stream in (("stdout", self.proc.stdout),
                                              ("stderr", self.proc.stderr))]
        for t in self._readers:
            t.start()
        deadline = time.monotonic() + ready_s
        while True:
            assert self.proc.poll() is None, f"serve exited: {self.output()}"
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"serve not ready: {self.output()}"
            time.sleep(0.5)

    def _read(self, name: str, stream) -> None:
        for raw in stream:
            self.lines[name].append(raw.decode("utf-8", "replace").rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines["stderr"][-40:] + self.lines["stdout"][-20:])

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGINT (Ctrl-C), wait for the exit, then read both streams to EOF; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        for t in self._readers:
            t.join(timeout_s)
        return rc
