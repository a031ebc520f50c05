"""Where the milliseconds of one request go: a timeline of a 1-token completion, one at a time.

    python bench/request_timeline.py [--seconds 4] [--source DIR] [-- extra `loraserve serve` args]

Starts `loraserve serve` (demo base and catalog; engine core in its own process) with a
sitecustomize hook that timestamps (time.perf_counter: CLOCK_MONOTONIC, one clock for both
processes) the entry and exit of the functions a request passes through: the HTTP handler
(`_answer`), the endpoint (`serve`), `CoreClient._submit` (queued for the core), `ProcessTransport._flush` (sent), `EngineCore._add`,
`EngineCore.serve` (the model), `EngineCoreProc._send_replies` and `CoreClient._deliver`. Then it sends
non-streamed 1-token completions one at a time, first on the base model, then on a resident
adapter, and prints the median time of each mark from the request's arrival in the handler.
`--source DIR` serves the loraserve found in DIR instead (e.g. `git archive HEAD` unpacked, with
loraserve/kernels and loraserve/catalog linked to ../kernels and ../catalog), to compare.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hot_path.py, beside this script
# the source tree, for a checkout run without an install; appended, so an installed or linked
# loraserve (scripts/gpu_check.sh) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import os
import statistics
import tempfile

from hot_path import ADAPTER, Server, load, loraserve_cmd

HOOK = r'''
import atexit, importlib.abc, importlib.util, inspect, os, sys, time
_log = []
_path = os.path.join(os.environ["LS_TRACE"], f"trace-{os.getpid()}.txt")
atexit.register(lambda: open(_path, "w").write("\n".join(f"{t:.7f} {n}" for t, n in _log)))
import signal
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
TARGETS = {
    "loraserve.server.app": [(None, "_answer")],
    "loraserve.server.endpoint": [(None, "serve")],
    "loraserve.engine.client.core_client": [("CoreClient", "_submit"), ("ProcessTransport", "_flush"),
                                     ("CoreClient", "_deliver")],
    "loraserve.engine.core.engine_core": [("EngineCore", "_add"), ("EngineCore", "serve")],
    "loraserve.engine.core.process": [("EngineCoreProc", "_send_replies")],
}
def _wrap(mod, cls, name):
    owner = getattr(mod, cls) if cls else mod
    fn = getattr(owner, name, None)
    if fn is None:
        return
    label = f"{cls}.{name}" if cls else name
    if inspect.iscoroutinefunction(fn):
        async def w(*a, **k):
            _log.append((time.perf_counter(), label + ">"))
            try:
                return await fn(*a, **k)
            finally:
                _log.append((time.perf_counter(), label + "<"))
    else:
        def w(*a, **k):
            _log.append((time.perf_counter(), label + ">"))
            try:
                return fn(*a, **k)
            finally:
                _log.append((time.perf_counter(), label + "<"))
    setattr(owner, name, w)
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            for cls, name in TARGETS[fullname]:
                _wrap(module, cls, name)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
'''

MARKS = [("serve>", "endpoint starts (body parsed, validated)"),
         ("CoreClient._submit>", "queued for the engine core (tokenized, adapter resolved)"),
         ("ProcessTransport._flush<", "sent to the engine core (end of the event-loop turn)"),
         ("EngineCore._add>", "the core has it"),
         ("EngineCore.serve>", "engine step starts"),
         ("EngineCore.serve<", "engine step ends (the model ran)"),
         ("CoreClient._deliver>", "output back in the API process"),
         ("serve<", "answer built"),
         ("_answer<", "handler returns (response goes out)")]


def timeline(trace_dir: Path, windows: list[tuple[float, float]]) -> list[dict[str, float]]:
    events = []
    for f in trace_dir.glob("trace-*.txt"):
        for line in f.read_text().splitlines():
            t, name = line.split()
            events.append((float(t), name))
    events.sort()
    out = []
    for lo, hi in windows:
        reqs, cur = [], None
        for t, name in events:
            if not lo <= t <= hi:
                continue
            if name == "_answer>":
                cur = {"_answer>": t}
                reqs.append(cur)
            elif cur is not None and name not in cur:
                cur[name] = t
        reqs = [r for r in reqs if "_answer<" in r][3:]  # the first few warm up
        out.append({m: 1e3 * statistics.median(r[m] - r["_answer>"] for r in reqs if m in r)
                    for m, _ in MARKS} | {"requests": len(reqs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--source", metavar="DIR")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    import time
    with tempfile.TemporaryDirectory(prefix="loraserve-timeline-") as tmp:
        hook, traces = Path(tmp) / "hook", Path(tmp) / "traces"
        hook.mkdir()
        traces.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        path = [str(hook)] + ([str(Path(args.source).resolve())] if args.source else [])
        server = Server("loraserve", loraserve_cmd(argv[cut + 1:]), "/health",
                        env={"LS_TRACE": str(traces), "PYTHONPATH": os.pathsep.join(path)},
                        cwd=str(Path(args.source).resolve()) if args.source else None)
        try:
            load(server, client="raw", concurrency=1, duration=1.0, stream=False, adapter=ADAPTER)  # warm-up
            windows, e2e = [], []
            for adapter in (None, ADAPTER):
                t0 = time.perf_counter()
                rep = load(server, client="raw", concurrency=1, duration=args.seconds, stream=False, adapter=adapter)
                windows.append((t0, time.perf_counter()))
                e2e.append(rep["e2e_s"]["p50"])
        finally:
            server.stop()
        rows = timeline(traces, windows)
    print(f"median ms from the request's arrival in the handler ({rows[0]['requests']} base, "
          f"{rows[1]['requests']} adapter requests)\n")
    print(f"| mark | base | adapter {ADAPTER} |\n|---|---:|---:|")
    for mark, text in MARKS:
        print(f"| {text} | {rows[0][mark]:.3f} | {rows[1][mark]:.3f} |")
    print(f"| client-side end to end (p50) | {1e3 * e2e[0]:.3f} | {1e3 * e2e[1]:.3f} |")


if __name__ == "__main__":
    main()
