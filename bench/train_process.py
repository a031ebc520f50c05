"""Training beside serving: slices in the engine core against a trainer process that maps the base
(issue 24's alternative, measured before choosing).

    python bench/train_process.py [--rounds 2] [--seconds 8] [--tokens 200] [--train-datums 8]
                                  [--train-tokens 64] [--train-max-tokens 512]

One `loraserve serve` (engine-core process) on the demo base. Each round runs, one after the
other (A B A B ...):

- in core: the Tinker SDK's loop (forward_backward on `--train-datums` datums of
  `--train-tokens` tokens, optim_step) against the server, whose core runs it in slices of
  `--train-max-tokens` between decode steps;
- trainer process: the same steps by `loraserve.train` (TrainingRun, rank 8 on attention, MLP and
  lm_head, one torch thread) in a process of its own whose base is the safetensors file mapped
  read-only (every weight a `torch.frombuffer` view of the mapping: no copy, page cache shared
  with any other process mapping the file);

while a streamed greedy generation of `--tokens` tokens runs on the server. Prints steps/s, the
serving gaps' p50 / p99, and memory of each process while training (peak RSS sampled every
50 ms; from /proc/<pid>/smaps_rollup at the end: RSS, shared and private bytes).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import tempfile
import threading
import time
import warnings

import httpx
import torch

os.environ.setdefault("TINKER_TELEMETRY", "0")
import mint  # noqa: E402
from mint import types  # noqa: E402

from bench.train_serve import RANK, free_port, gaps, pct, serve, sft_datum  # noqa: E402

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def mapped_model(model_dir: Path):
    """The base with every weight a read-only view of its safetensors file's mapping (one file,
    stored in the dtype it trains in: otherwise a cast would copy it)."""
    from loraserve.model.config import ModelConfig
    from loraserve.model.transformer import CausalLM
    path = model_dir / "model.safetensors"
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    n = struct.unpack("<Q", mm[:8])[0]
    header = {k: v for k, v in json.loads(mm[8:8 + n]).items() if k != "__metadata__"}
    config = ModelConfig.from_dir(model_dir)
    config.tie_word_embeddings = "lm_head.weight" not in header
    model = CausalLM(config, device="meta")
    with warnings.catch_warnings():  # a read-only buffer: nothing here writes to the base
        warnings.simplefilter("ignore")
        for name, _ in list(model.named_parameters()):
            h = header[name]
            start, end = h["data_offsets"]
            dtype = DTYPES[h["dtype"]]
            view = torch.frombuffer(mm, dtype=dtype, count=(end - start) // dtype.itemsize, offset=8 + n + start)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, torch.nn.Parameter(view.view(h["shape"]), requires_grad=False))
    model.tie_weights()
    model.model.rotary_emb.reset_buffers(torch.device("cpu"))
    return model.eval()


def trainer_main(model_dir: str, datums: int, tokens: int) -> None:
    """The trainer process: 'ready' once warm, trains from 'go' to 'stop' (stdin), then prints
    {steps, seconds}."""
    from loraserve.train.config import RunConfig
    from loraserve.train.run import AdamParams, Datum, TrainingRun
    torch.set_num_threads(1)
    run = TrainingRun(mapped_model(Path(model_dir)), RunConfig(rank=RANK, seed=1))
    toks = torch.tensor([(7 * i) % 250 + 1 for i in range(tokens + 1)])
    data = [Datum(toks[:-1], {"target_tokens": toks[1:], "weights": torch.ones(tokens)})] * datums

    def step() -> None:
        p = run.start(data, "cross_entropy")
        while not p.advance(tokens * datums):
            pass
        p.finish()
        run.optim_step(AdamParams(learning_rate=1e-4))

    step()
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    t0, steps = time.perf_counter(), 0
    while not stop.is_set():
        step()
        steps += 1
    print(json.dumps({"steps": steps, "seconds": time.perf_counter() - t0}), flush=True)


def smaps(pid: int) -> dict[str, int]:
    """RSS, shared and private bytes of `pid` (/proc/<pid>/smaps_rollup)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return {"rss": out["Rss"], "shared": out["Shared_Clean"] + out["Shared_Dirty"],
            "private": out["Private_Clean"] + out["Private_Dirty"]}


class Peak:
    """Peak RSS of some processes, sampled every 50 ms while in the block."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak, self._stop = pids, {p: 0 for p in pids}, threading.Event()

    def __enter__(self) -> Peak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            for p in self.pids:
                self.peak[p] = max(self.peak[p], smaps(p)["rss"])
            if self._stop.wait(0.05):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()



def in_core(url: str, http: httpx.Client, args: argparse.Namespace, core: int) -> dict:
    service = mint.ServiceClient(base_url=url, api_key="tml-bench")
    trainer = service.create_lora_training_client(base_model="qwen3", rank=RANK, seed=1)
    data = [sft_datum(args.train_tokens)] * args.train_datums
    trainer.forward_backward(data, "cross_entropy").result()  # warm
    stop, steps = threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            steps[0] += 1

    with Peak([core]) as peak:
        worker = threading.Thread(target=loop)
        worker.start()
        time.sleep(1.0)
        t0, s0 = time.perf_counter(), steps[0]
        loaded = _stream_for(http, args)
        rate = (steps[0] - s0) / (time.perf_counter() - t0)
        mem = {"core": smaps(core)}
        stop.set()
        worker.join()
    return {"rate": rate, "gaps": loaded, "mem": mem, "peak": {"core": peak.peak[core]}}


def _stream_for(http: httpx.Client, args: argparse.Namespace) -> list[float]:
    """Streams of `--tokens` tokens back to back for at least `--seconds`: their gaps."""
    out, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        out += gaps(http, args.tokens)
    return out


def trainer_process(http: httpx.Client, model_dir: Path, args: argparse.Namespace, core: int) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--trainer", str(model_dir), "--train-datums",
                             str(args.train_datums), "--train-tokens", str(args.train_tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with Peak([core, proc.pid]) as peak:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(1.0)
            loaded = _stream_for(http, args)
            mem = {"core": smaps(core), "trainer": smaps(proc.pid)}
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            done = json.loads(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return {"rate": done["steps"] / done["seconds"], "gaps": loaded, "mem": mem,
            "peak": {"core": peak.peak[core], "trainer": peak.peak[proc.pid]}}


def _mib(x: int) -> str:
    return f"{x / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--train-datums", type=int, default=8)
    ap.add_argument("--train-tokens", type=int, default=64)
    ap.add_argument("--train-max-tokens", type=int, default=512)
    ap.add_argument("--trainer", metavar="MODEL_DIR", help=argparse.SUPPRESS)  # the trainer process
    args = ap.parse_args()
    if args.trainer:
        return trainer_main(args.trainer, args.train_datums, args.train_tokens)
    from loraserve.demo import build_demo
    demo = build_demo(Path(".loraserve/demo"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(demo.catalog, root / "catalog")
        port = free_port()
        proc = serve(demo.qwen3, root / "catalog", root, port, args.train_max_tokens)
        url = f"http://127.0.0.1:{port}"
        try:
            kids = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
            core = max(kids, key=lambda pid: smaps(pid)["rss"])  # not multiprocessing's resource tracker
            with httpx.Client(base_url=url, timeout=120) as http:
                alone = _stream_for(http, args)
                idle = smaps(core)
                for r in range(args.rounds):
                    rows.append(("in core", r, in_core(url, http, args, core)))
                    rows.append(("trainer process", r, trainer_process(http, demo.qwen3, args, core)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"serving alone: ITL p50 / p99 {pct(alone, 50):.2f} / {pct(alone, 99):.2f} ms; engine core idle: "
          f"RSS {_mib(idle['rss'])} MiB (shared {_mib(idle['shared'])}, private {_mib(idle['private'])})\n")
    print("| where training runs | round | training steps/s | ITL while training p50 / p99 (ms) |"
          " core RSS / shared / private (MiB) | core peak RSS (MiB) |"
          " trainer RSS / shared / private (MiB) | trainer peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r, m in rows:
        c, t = m["mem"]["core"], m["mem"].get("trainer")
        trainer = f"{_mib(t['rss'])} / {_mib(t['shared'])} / {_mib(t['private'])} | {_mib(m['peak']['trainer'])}" \
            if t else "- | -"
        print(f"| {mode} | {r + 1} | {m['rate']:.2f} | {pct(m['gaps'], 50):.2f} / {pct(m['gaps'], 99):.2f} |"
              f" {_mib(c['rss'])} / {_mib(c['shared'])} / {_mib(c['private'])} | {_mib(m['peak']['core'])} |"
              f" {trainer} |")
    print(f"\nmedian steps/s: in core {statistics.median(m['rate'] for k, _, m in rows if k == 'in core'):.2f},"
          f" trainer process {statistics.median(m['rate'] for k, _, m in rows if k != 'in core'):.2f}")


if __name__ == "__main__":
    main()
