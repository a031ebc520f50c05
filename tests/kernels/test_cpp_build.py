"""Every library `kernels.cpp_build` makes uses ATen's thread pool (session 13: `cpu_quant` was
built without -fopenmp, so its `at::parallel_for` ran on one thread and a quantized base's GEMVs
at half the speed two cores give, with no error anywhere)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraserve.kernels import cpp_build

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <mutex>
#include <set>

// How many distinct threads ran the chunks of a parallel_for over `n` items, one item a chunk.
int64_t threads_used(int64_t n) {
  std::mutex m;
  std::set<int> seen;
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    std::lock_guard<std::mutex> g(m);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}

TORCH_LIBRARY(loraserve_test_cpp_build, m) { m.def("threads_used(int n) -> int", &threads_used); }
"""


def test_a_built_library_runs_parallel_for_on_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "threads_used.cpp"
    source.write_text(SOURCE)
    lib = cpp_build.library("threads_used", source)
    torch.ops.load_library(str(lib))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.loraserve_test_cpp_build.threads_used(8) == 2
        torch.set_num_threads(1)
        assert torch.ops.loraserve_test_cpp_build.threads_used(8) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernel", ["cpu_fused", "cpu_gemv", "cpu_quant"])
def test_threads_asking_while_a_library_loads_get_its_answer(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call builds and loads the library; threads asking meanwhile wait for that
    answer. They used to read "unavailable" from the state the first call set before its build,
    and take torch's path (for good where a decode plan decides once)."""
    import importlib
    import threading
    import time

    mod = importlib.import_module(f"loraserve.kernels.{kernel}")
    ask = {"cpu_fused": lambda: mod.available(), "cpu_gemv": lambda: mod.supports(torch.float32),
           "cpu_quant": lambda: mod.available()}[kernel]
    expected = ask()  # loaded now (or known to be unavailable here)
    real = cpp_build.library

    def slow(*args, **kwargs):  # a build in progress
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpp_build, "library", slow)
    monkeypatch.setattr(mod, "_state", {})  # as in a fresh process: the first call loads
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(ask())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == [expected] * 4
