"""Training and serving on one resident base (issue 24): the handoff, and serving under training.

    python bench/train_serve.py [--handoffs 7] [--tokens 200] [--train-datums 8] [--train-tokens 64]
                                [--train-max-tokens 64,512] [--source DIR]...

Starts `loraserve serve` (the engine-core process) on the demo base with a copy of the demo
catalog, once per `--train-max-tokens` value (and per `--source` tree: `git archive` of an older
commit unpacked, served by its own code, for before/after rows), and drives it with the Tinker
SDK (training) and httpx (serving). Prints two tables:

- handoff: from "the trainer has new factors" to the first token of the new revision.
  `save_weights_and_get_sampling_client` then a one-token sample from that sampler (the RL
  loop's path); `save_weights_for_sampler(name)` then the first token on /v1 by the revision's
  name; against the path without either: write a PEFT directory (the export) and
  `POST /v1/load_lora_adapter` (the server's `catalog import`), then the same first token on
  /v1. Median of `--handoffs` each, side by side.
- serving: inter-token gaps of one streamed greedy generation of `--tokens` tokens on the base,
  alone and while a training loop (forward_backward on `--train-datums` datums of `--train-tokens`
  tokens, optim_step) runs without pause; p50 / p99 gap, and the training steps per second
  meanwhile. A slice holds whole datums, so `--train-max-tokens` 64 runs the pass in 8 slices
  with a decode step after each, 512 in one.
- runs (`--runs 1,3,8`, on the last server): N runs of `--steps` steps each (the same passes),
  one after another against all at once (a thread each); wall time and the peak resident memory
  of the server and its engine core during each (sampled every 20 ms). Runs at once share
  slices: the core batches their waiting datums into one forward/backward (train/grouped.py).
  `--handoffs 0` measures the runs table alone.
- tenants (`--latency-runs 1,4,8`: this table alone, per `--train-max-tokens` and tree): a third
  tenant's streamed 16-token chats (`--chats` of them, one after another) on a server with keys
  for three tenants, idle and while N training runs of two other tenants (half each) loop
  forward_backward on `--train-datums` datums of `--train-tokens` tokens + optim_step without
  pause; its TTFT and inter-token gaps, p50 / p99, against idle (ratios), and the training
  throughput (datum tokens forward and backward per second, from the runs' start until each ended
  the step in hand after the chats). The attacker's mix: `--latency-runs 1,4,8 --train-datums 4
  --train-tokens 1900 --train-max-tokens 512`.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time

import httpx
import torch
from safetensors.torch import save_file

os.environ.setdefault("TINKER_TELEMETRY", "0")
import mint  # noqa: E402
from mint import types  # noqa: E402

RANK, ALPHA = 8, 32.0  # ALPHA: the server's (loraserve.train.config.DEFAULT_ALPHA)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, catalog: Path, root: Path, port: int, train_max_tokens: int,
          source: str | None = None, extra: list[str] | None = None,
          max_model_len: int = 1024) -> subprocess.Popen:
    """`loraserve serve` on port; from the source tree `source` when given (else this one)."""
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(model.resolve()),
           "--catalog", str(catalog), "--port", str(port), "--adapter-root", str(root),
           "--train-max-tokens", str(train_max_tokens), "--max-model-len", str(max_model_len),
           *(extra or [])]
    env = None if source is None else {**os.environ, "PYTHONPATH": str(Path(source).resolve())}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=source)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"loraserve serve exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("loraserve serve did not become ready")


def first_token(http: httpx.Client, model: str) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                                           "temperature": 0})
    r.raise_for_status()


def write_peft(out: Path, n_layers: int, shapes: dict[str, tuple[int, int]], seed: int) -> None:
    """A PEFT adapter of the run's shape (every layer's attention + MLP, lm_head): the export."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(n_layers):
        for kind, (fan_in, fan_out) in shapes.items():
            group = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{group}.{kind}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": sorted(shapes),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))


def sft_datum(n: int) -> types.Datum:
    toks = [(7 * i) % 250 + 1 for i in range(n + 1)]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * n})


def handoff(url: str, http: httpx.Client, root: Path, model: Path, rounds: int) -> tuple[list, list, list]:
    service = mint.ServiceClient(base_url=url, api_key="tml-bench")
    trainer = service.create_lora_training_client(base_model="qwen3", rank=RANK, seed=0)
    cfg = json.loads((model / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    sampler, named, export = [], [], []
    for r in range(rounds):
        trainer.forward_backward([sft_datum(32)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        t0 = time.perf_counter()
        trainer.save_weights_and_get_sampling_client().sample(
            prompt=types.ModelInput.from_ints([5, 6, 7, 8]), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0)).result()
        sampler.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.save_weights_for_sampler(f"h{r}").result()
        first_token(http, f"default/{trainer.model_id}@h{r}")
        named.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        write_peft(root / f"peft-{r}", cfg["num_hidden_layers"], shapes, r)
        http.post("/v1/load_lora_adapter", json={"lora_name": f"default/peft-{r}",
                                                 "lora_path": str(root / f"peft-{r}")}).raise_for_status()
        first_token(http, f"default/peft-{r}")
        export.append(time.perf_counter() - t0)
    return sampler, named, export


def gaps(http: httpx.Client, tokens: int) -> list[float]:
    """Inter-token gaps (s) of one streamed greedy generation on the base."""
    body = {"model": "qwen3", "prompt": [5, 6, 7, 8], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def serving(url: str, http: httpx.Client, tokens: int, datums: int, train_tokens: int) -> dict[str, tuple]:
    alone = gaps(http, tokens)
    service = mint.ServiceClient(base_url=url, api_key="tml-bench")
    trainer = service.create_lora_training_client(base_model="qwen3", rank=RANK, seed=1)
    stop, steps = threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            trainer.forward_backward([sft_datum(train_tokens)] * datums, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            steps[0] += 1

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    time.sleep(1.0)  # training under way
    t0, s0 = time.perf_counter(), steps[0]
    loaded = gaps(http, tokens)
    rate = (steps[0] - s0) / (time.perf_counter() - t0)
    stop.set()
    worker.join(timeout=60)
    return {"alone": (alone, None), "training": (loaded, rate)}


def rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` and its children (the engine-core process)."""
    total = 0
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, kids)]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def run_steps(url: str, service, seed: int, steps: int, datums: int, tokens: int) -> None:
    trainer = service.create_lora_training_client(base_model="qwen3", rank=RANK, seed=seed)
    for _ in range(steps):
        trainer.forward_backward([sft_datum(tokens)] * datums, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    # the SDK's TrainingClient has no unload: its REST route (a future, answered when done)
    with httpx.Client(base_url=url, timeout=60) as http:
        future = http.post("/api/v1/unload_model", json={"model_id": trainer.model_id}).json()
        http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).raise_for_status()


def runs_table(url: str, pid: int, counts: list[int], args: argparse.Namespace) -> list[str]:
    service = mint.ServiceClient(base_url=url, api_key="tml-bench")
    rows = []
    for n in counts:
        out = []
        for mode in ("one after another", "at once"):
            peak, stop = [rss_bytes(pid)], threading.Event()

            def sample() -> None:
                while not stop.wait(0.02):
                    peak[0] = max(peak[0], rss_bytes(pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.perf_counter()
            jobs = [lambda i=i: run_steps(url, service, i, args.steps, args.train_datums, args.train_tokens)
                    for i in range(n)]
            if mode == "at once":
                threads = [threading.Thread(target=job) for job in jobs]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                for job in jobs:
                    job()
            out.append((time.perf_counter() - t0, peak[0]))
            stop.set()
            sampler.join()
        (seq_s, seq_m), (con_s, con_m) = out
        rows.append(f"| {n} | {seq_s:.1f} | {con_s:.1f} | {seq_s / con_s:.2f}x | {seq_m / 2**20:.0f} | {con_m / 2**20:.0f} |")
    return rows


# -- serving latency of a third tenant under other tenants' training -----------------------------

def chat(http: httpx.Client, key: str, tokens: int) -> tuple[float, list[float]]:
    """One streamed greedy chat of `tokens` tokens: (TTFT, inter-token gaps), seconds."""
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Who are you?"}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0, stamps = time.perf_counter(), []
    with http.stream("POST", "/v1/chat/completions", json=body,
                     headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]


def chats(http: httpx.Client, key: str, n: int, tokens: int) -> tuple[list[float], list[float]]:
    """`n` chats one after another, a pause of 0-50 ms between (not in step with the slices)."""
    rng = random.Random(0)
    ttft, itl = [], []
    for _ in range(n):
        first, gaps = chat(http, key, tokens)
        ttft.append(first)
        itl += gaps
        time.sleep(rng.uniform(0, 0.05))
    return ttft, itl


def training_load(url: str, keys: list[str], runs: int, args: argparse.Namespace):
    """`runs` training runs (alternately in the tenants of `keys`), each looping forward_backward
    + optim_step until stopped, in a process of their own (`--train-worker`: their SDK threads do
    not share this process's GIL with the chats measured). Returns (stop(), steps done so far (a
    list of one int)), once every run has its first pass queued."""
    worker = subprocess.Popen([sys.executable, __file__, "--train-worker", url, ",".join(keys), str(runs),
                               str(args.train_datums), str(args.train_tokens)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    steps = [0]
    assert worker.stdout.readline().strip() == "ready"

    def count() -> None:
        for line in worker.stdout:
            steps[0] += line.strip() == "step"

    counter = threading.Thread(target=count, daemon=True)
    counter.start()

    def finish() -> None:
        worker.stdin.write("stop\n")
        worker.stdin.close()
        worker.wait(timeout=3600)
        counter.join()

    return finish, steps


def train_worker(url: str, keys: list[str], runs: int, datums: int, tokens: int) -> None:
    """The runs of `training_load`: "ready" once each has its first pass queued, "step" per
    optim_step, until a line on stdin; then each run is unloaded."""
    stop, ready, lock = threading.Event(), threading.Barrier(runs + 1), threading.Lock()
    data = [sft_datum(tokens)] * datums

    def loop(i: int) -> None:
        service = mint.ServiceClient(base_url=url, api_key=keys[i % len(keys)])
        trainer = service.create_lora_training_client(base_model="qwen3", rank=RANK, seed=i)
        fb = trainer.forward_backward(data, "cross_entropy")
        ready.wait()
        while True:
            fb.result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            with lock:
                print("step", flush=True)
            if stop.is_set():
                break
            fb = trainer.forward_backward(data, "cross_entropy")
        with httpx.Client(base_url=url, timeout=3600, headers={"Authorization": f"Bearer {keys[i % len(keys)]}"}) as h:
            future = h.post("/api/v1/unload_model", json={"model_id": trainer.model_id}).json()
            h.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]})

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(runs)]
    for t in threads:
        t.start()
    ready.wait()
    print("ready", flush=True)
    sys.stdin.readline()
    stop.set()
    for t in threads:
        t.join()


def latency_rows(demo, budget: int, source: str | None, args: argparse.Namespace) -> list[str]:
    """The tenants table's rows for one server (this tree or `source`) at one budget."""
    from loraserve.keys import Principal, append_key

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(demo.catalog, root / "catalog")
        keys_file = root / "keys.toml"
        trainers = [append_key(keys_file, Principal(t, admin=False, tenants=(t,))) for t in ("lab-a", "lab-b")]
        chatter = append_key(keys_file, Principal("chat", admin=False, tenants=("chat",)))
        port = free_port()
        proc = serve(demo.qwen3, root / "catalog", root, port, budget, source, ["--keys", str(keys_file)],
                     max_model_len=max(1024, args.train_tokens + 8))
        url = f"http://127.0.0.1:{port}"
        rows = []
        try:
            with httpx.Client(base_url=url, timeout=3600) as http:
                chats(http, chatter, 3, args.chat_tokens)  # warm-up: serving, then one training step
                training_load(url, trainers, 1, argparse.Namespace(train_datums=1, train_tokens=16))[0]()
                idle_ttft, idle_itl = chats(http, chatter, args.chats, args.chat_tokens)
                rows.append(_latency_row(source, budget, 0, idle_ttft, idle_itl, None, None))
                for runs in [int(x) for x in args.latency_runs.split(",")]:
                    t0 = time.perf_counter()
                    finish, steps = training_load(url, trainers, runs, args)
                    time.sleep(1.0)  # slices under way
                    ttft, itl = chats(http, chatter, args.chats, args.chat_tokens)
                    finish()  # each run ends the step in hand
                    rate = steps[0] * args.train_datums * args.train_tokens / (time.perf_counter() - t0)
                    rows.append(_latency_row(source, budget, runs, ttft, itl, (idle_ttft, idle_itl), rate))
                    print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def core_latency_rows(demo, budget: int, args: argparse.Namespace) -> list[str]:
    """The tenants table without HTTP (`--in-core`): the engine in this process (AsyncEngine,
    the `--single-process` hosting), the runs through its trainer (tenants lab-a and lab-b), the
    chats as the server sends them (tenant "" of the base, the chat template's prompt), their
    TTFT and gaps read off the engine's deltas. What the engine itself does, without the API
    server's, the SDK's and the machine's other processes' share of the two cores."""
    import asyncio

    from loraserve.engine.async_engine import AsyncEngine
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.types import GenerateRequest, SamplingParams

    cfg = EngineConfig(model_dir=str(demo.qwen3), device="cpu", max_model_len=max(1024, args.train_tokens + 8),
                       train_max_tokens=budget)
    eng = AsyncEngine.from_config(cfg)
    tok = eng.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Who are you?"}]))
    toks = [(7 * i) % 250 + 1 for i in range(args.train_tokens + 1)]
    datum = [toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * args.train_tokens}]
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    ids = iter(range(10**9))

    async def chat() -> tuple[float, list[float]]:
        req = GenerateRequest(f"chat-{next(ids)}", prompt, SamplingParams(
            max_tokens=args.chat_tokens, temperature=0.0, ignore_eos=True), stream=True)
        t0, stamps = time.perf_counter(), []
        async for out in eng.generate(req):
            stamps += [time.perf_counter()] * len(out.token_ids)
        return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]

    async def chats(n: int) -> tuple[list[float], list[float]]:
        rng, ttft, itl = random.Random(0), [], []
        for _ in range(n):
            first, gaps = await chat()
            ttft.append(first)
            itl += gaps
            await asyncio.sleep(rng.uniform(0, 0.05))
        return ttft, itl

    async def main() -> list[str]:
        await eng.start()
        await chats(3)  # warm-up: serving, then one training step
        await eng.trainer.create("warm", {"rank": RANK, "seed": 0})
        await eng.trainer.run_pass("warm", [datum], "cross_entropy", None, True, "lab-a")
        await eng.trainer.optim_step("warm", adam)
        await eng.trainer.drop("warm")
        idle = await chats(args.chats)
        rows = [_latency_row("in core", budget, 0, *idle, None, None)]
        for runs in [int(x) for x in args.latency_runs.split(",")]:
            stop, steps = asyncio.Event(), [0]

            async def run(i: int) -> None:
                run_id = f"b{runs}-{i}"
                await eng.trainer.create(run_id, {"rank": RANK, "seed": i, "train_attn": True, "train_mlp": True,
                                                  "train_unembed": True})
                while not stop.is_set():
                    await eng.trainer.run_pass(run_id, [datum] * args.train_datums, "cross_entropy", None, True,
                                               ("lab-a", "lab-b")[i % 2])
                    await eng.trainer.optim_step(run_id, adam)
                    steps[0] += 1
                await eng.trainer.drop(run_id)

            t0 = time.perf_counter()
            tasks = [asyncio.create_task(run(i)) for i in range(runs)]
            await asyncio.sleep(1.0)
            ttft, itl = await chats(args.chats)
            stop.set()
            await asyncio.gather(*tasks)  # each run ends the step in hand
            rate = steps[0] * args.train_datums * args.train_tokens / (time.perf_counter() - t0)
            rows.append(_latency_row("in core", budget, runs, ttft, itl, idle, rate))
            print(rows[-1], flush=True)
        await eng.shutdown()
        return rows

    return asyncio.run(main())


def _latency_row(source, budget, runs, ttft, itl, idle, rate) -> str:
    def cell(xs, base, q):
        v = pct(xs, q)
        return f"{v:.0f}" if base is None else f"{v:.0f} ({v / pct(base, q):.1f}x)"

    it, ii = (None, None) if idle is None else idle
    return (f"| {source or 'this tree'} | {budget} | {runs or 'idle'} | {cell(ttft, it, 50)} | {cell(ttft, it, 99)} |"
            f" {cell(itl, ii, 50)} | {cell(itl, ii, 99)} | {max(itl) * 1e3:.0f} |"
            f" {'' if rate is None else f'{rate:.0f}'} |")


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) > 1 else float("nan")


def measure(demo, budget: int, source: str | None, args: argparse.Namespace, runs: bool) -> tuple[str, list[str]]:
    """One server (this tree or `source`) at one budget: its row of the first table, and the
    runs table's rows when `runs`."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(demo.catalog, root / "catalog")
        port = free_port()
        proc = serve(demo.qwen3, root / "catalog", root, port, budget, source)
        url = f"http://127.0.0.1:{port}"
        try:
            if args.handoffs:
                with httpx.Client(base_url=url, timeout=120) as http:
                    sampler, named, export = handoff(url, http, root, demo.qwen3, args.handoffs)
                    itl = serving(url, http, args.tokens, args.train_datums, args.train_tokens)
            rows = runs_table(url, proc.pid, [int(x) for x in args.runs.split(",")], args) if runs else []
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if not args.handoffs:
        return None, rows
    a, n, b = (statistics.median(xs) * 1e3 for xs in (sampler, named, export))
    alone, (loaded, rate) = itl["alone"][0], itl["training"]
    return (f"| {source or 'this tree'} | {budget} | {a:.1f} | {n:.1f} | {b:.1f} | {b / a:.2f}x |"
            f" {pct(alone, 50):.2f} / {pct(alone, 99):.2f} | {pct(loaded, 50):.2f} / {pct(loaded, 99):.2f} |"
            f" {rate:.1f} |"), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handoffs", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--train-datums", type=int, default=8)
    ap.add_argument("--train-tokens", type=int, default=64)
    ap.add_argument("--train-max-tokens", default="64,512")
    ap.add_argument("--runs", default="1,3,8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--source", metavar="DIR", action="append", default=[],
                    help="also serve from this source tree (e.g. `git archive` of an older commit), one row each")
    ap.add_argument("--latency-runs", default="", metavar="N,N,..",
                    help="measure the tenants table alone: a third tenant's chats with N runs training")
    ap.add_argument("--chats", type=int, default=30, help="chats per row of the tenants table")
    ap.add_argument("--chat-tokens", type=int, default=16)
    ap.add_argument("--in-core", action="store_true",
                    help="the tenants table without HTTP too: the engine in this process (AsyncEngine)")
    ap.add_argument("--no-http", action="store_true", help="the tenants table: the in-core rows only")
    ap.add_argument("--sources-only", action="store_true", help="the tenants table: the --source trees only")
    if sys.argv[1:2] == ["--train-worker"]:
        url, keys, runs, datums, tokens = sys.argv[2:7]
        train_worker(url, keys.split(","), int(runs), int(datums), int(tokens))
        return
    args = ap.parse_args()
    from loraserve.demo import build_demo
    demo = build_demo(Path(".loraserve/demo"))
    budgets = [int(x) for x in args.train_max_tokens.split(",")]
    if args.latency_runs:
        trees = [] if args.no_http else [*([] if args.sources_only else [None]), *args.source]
        rows = [row for budget in budgets for source in trees for row in latency_rows(demo, budget, source, args)]
        if args.in_core or args.no_http:
            rows += [row for budget in budgets for row in core_latency_rows(demo, budget, args)]
        print("\n| tree | --train-max-tokens | runs training | chat TTFT p50 (ms) | TTFT p99 (ms) |"
              " inter-token p50 (ms) | inter-token p99 (ms) | longest gap (ms) | training tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        return
    rows, runs_rows = [], []
    for budget in budgets:  # trees interleaved per budget: what the machine's load does hits both
        for source in [None, *args.source]:
            row, more = measure(demo, budget, source, args, runs=bool(args.runs) and budget == budgets[-1])
            rows += [row] if row else []
            runs_rows += [f"| {source or 'this tree'} | {r[2:]}" for r in more]
    if rows:
        print_rows(rows)
    if runs_rows:
        print(f"\n| tree | runs (--train-max-tokens {budgets[-1]}) | one after another (s) | at once (s) | ratio |"
              " peak RSS one after another (MiB) | peak RSS at once (MiB) |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(runs_rows))


def print_rows(rows: list[str]) -> None:
    print("| tree | --train-max-tokens | handoff: sampler save -> sample (ms) | handoff: named save -> /v1 (ms) |"
          " handoff: export + import -> /v1 (ms) | export / sampler | ITL alone p50 / p99 (ms) |"
          " ITL while training p50 / p99 (ms) | training steps/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
