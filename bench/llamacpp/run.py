"""loraserve against llama.cpp's `llama-server`: same model, same adapters, one interleaved run.

    bash bench/llamacpp/build.sh                                     # llama-server + converter venv
    .loraserve/llamacpp/venv/bin/python bench/llamacpp/make_model.py --out .loraserve/llamacpp/h512
    .venv/bin/python bench/llamacpp/run.py --model-dir .loraserve/llamacpp/h512 [--reps 7] [--threads 2,1]

Not part of `make test`. For each thread count, both servers run side by side (each told to use
that many compute threads: llama.cpp `-t/-tb`, loraserve `--torch-threads`), with prompt caching
off on both. Each batch is 32 concurrent `/v1/completions` requests x 32 new tokens, greedy,
`ignore_eos`, and a per-request adapter: loraserve by name (`"model": "bench/aNN"`), llama.cpp by
its `lora` field (`[{"id": N, "scale": 1.0}]`; every adapter is loaded at start, at scale 0, so a
request without `lora` is the base). Mixes: the base alone, 1 adapter, 8 adapters, 32 adapters.
Both run float32 weights and KV cache; llama.cpp's flash attention is off (`--llama-flash-attn`).
`--dtype bfloat16` (or float16) runs both at that type instead: loraserve `--dtype`, llama.cpp the
GGUFs `make_model.py --outtypes f32,bf16` wrote and its KV cache in that type; the references are
transformers + PEFT at that type too. Rounding differs between the three, so a greedy output may
leave the others after some tokens: each mix prints where the first difference falls, and such
mixes are timed anyway (the texts each server gave in step 1 stay the check of its timed runs).

1. Correctness first, per mix: every request's greedy token ids from loraserve (logprobs with
   `return_tokens_as_token_ids`) and from llama.cpp (`/completion` with `return_tokens`) must be
   equal, and equal to transformers + PEFT (`generate`, one prompt at a time). The prompt texts
   must also tokenize the same in both servers. A mix with a mismatch is reported and not timed.
2. Timing: `--reps` rounds; in each round every mix runs once on each server, the order of the two
   servers alternating, so noise from the rest of the (shared) machine lands on both. Every timed
   response's text is checked against the texts of step 1.
Prints, per mix and thread count, tokens/s (median and min-max over rounds), the ratio
loraserve / llama.cpp within each round (median, min-max: the figure to quote on a noisy
machine), each server's own CPU time per generated token (its process tree, from /proc), and how
many cores the rest of the machine kept busy meanwhile (the noise each figure ran under).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIXES = {"base": 0, "1 adapter": 1, "8 adapters": 8, "32 adapters": 32}


CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (loraserve's engine process)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                raw = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            f = raw[raw.rindex(")") + 2:].split()   # fields after the command name
            stats[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / CLK_TCK)   # ppid, utime+stime
    tree, frontier = set(), {pid}
    while frontier:
        tree |= frontier
        frontier = {p for p, (pp, _) in stats.items() if pp in frontier} - tree
    return sum(stats[p][1] for p in tree if p in stats)


def machine_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used (from /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / CLK_TCK   # all but idle and iowait


def rate(tok_s: float) -> str:
    """Tokens/s to print: whole numbers from 100 on, three significant digits below (one stream)."""
    return f"{tok_s:.0f}" if tok_s >= 100 else f"{tok_s:.3g}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adapter_of(mix: str, i: int) -> int | None:
    """The adapter index of request i in `mix` (None: the base)."""
    n = MIXES[mix]
    return None if n == 0 else i % n


# loraserve --dtype -> the GGUF type and llama.cpp KV cache type of the same precision
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


# ---------------------------------------------------------------------------------------------
# setup: loraserve catalog, reference outputs


def ensure_catalog(model_dir: Path, n: int) -> Path:
    """Import the PEFT adapters into a loraserve catalog with the CLI (once)."""
    cat = model_dir / "catalog"
    done = cat / ".bench-imported"
    if done.is_file() and int(done.read_text()) >= n:
        return cat
    if cat.exists():
        shutil.rmtree(cat)
    cli = str(ROOT / ".venv" / "bin" / "loraserve")
    subprocess.run([cli, "catalog", "init", str(cat), "--shards", "8"], check=True)
    for i in range(n):
        subprocess.run([cli, "catalog", "import", str(cat), f"bench/a{i:02d}",
                        str(model_dir / "peft" / f"a{i:02d}"), "--model", str(model_dir / "hf"),
                        "--promote"], check=True, stdout=subprocess.DEVNULL)
    done.write_text(str(n))
    return cat


def reference_outputs(model_dir: Path, prompts: list[list[int]], pairs: set[tuple[int, int | None]],
                      tokens: int, dtype: str = "float32") -> dict[tuple[int, int | None], list[int]]:
    """transformers + PEFT greedy ids for each (prompt, adapter) pair, at `dtype` (the float32
    checkpoint cast, as both servers do), cached on disk."""
    path = model_dir / (f"reference-{tokens}.json" if dtype == "float32" else
                        f"reference-{tokens}-{GGUF_TYPES[dtype]}.json")
    cache = {}
    if path.is_file():
        cache = {(int(p), None if a == "base" else int(a)): v
                 for p, a, v in json.loads(path.read_text())}
    # a longer run's references, cut: greedy decoding's first `tokens` ids do not depend on how
    # many come after (EOS is never picked: make_model.py)
    suffix = "" if dtype == "float32" else f"-{GGUF_TYPES[dtype]}"
    for longer in sorted(model_dir.glob("reference-*.json")):
        m = re.fullmatch(rf"reference-(\d+){suffix}\.json", longer.name)
        if m and int(m[1]) > tokens:
            for p, a, v in json.loads(longer.read_text()):
                cache.setdefault((int(p), None if a == "base" else int(a)), v[:tokens])
    todo = sorted(pairs - cache.keys(), key=lambda pa: (pa[1] is not None, pa[1] or 0, pa[0]))
    if todo:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(2)
        base = AutoModelForCausalLM.from_pretrained(model_dir / "hf", dtype=getattr(torch, dtype)).eval()
        adapters = sorted({a for _, a in todo if a is not None})
        model = None
        for a in adapters:
            if model is None:
                model = PeftModel.from_pretrained(base, model_dir / "peft" / f"a{a:02d}", adapter_name=f"a{a:02d}")
            else:
                model.load_adapter(model_dir / "peft" / f"a{a:02d}", adapter_name=f"a{a:02d}")
        model = (model or base).eval()
        with torch.no_grad():
            for p, a in todo:
                ids = torch.tensor([prompts[p]])
                kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
                if a is None:
                    if model is base:
                        out = base.generate(ids, **kw)
                    else:
                        with model.disable_adapter():
                            out = model.generate(input_ids=ids, **kw)
                else:
                    model.set_adapter(f"a{a:02d}")
                    out = model.generate(input_ids=ids, **kw)
                cache[(p, a)] = out[0, ids.shape[1]:].tolist()
        del model, base
        path.write_text(json.dumps([[p, "base" if a is None else a, v] for (p, a), v in sorted(
            cache.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]))]))
    return cache


# ---------------------------------------------------------------------------------------------
# servers


class Server:
    name: str
    proc: subprocess.Popen
    url: str
    cmd: list[str]

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} not ready after {timeout} s; see {self.log}")

    def start(self, log: Path) -> "Server":
        self.log = log
        self.proc = subprocess.Popen(self.cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LoraServe(Server):
    name = "loraserve"

    def __init__(self, model_dir: Path, catalog: Path, threads: int, n_adapters: int, batch: int,
                 max_len: int, extra: list[str] = (), binary: Path | None = None,
                 dtype: str = "float32", model: Path | None = None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # another model file (a quantized GGUF) is served as the server serves it by default:
        # no --dtype (a float --dtype would dequantize it), and the catalog's adapters, made on
        # the float checkpoint, allowed on its quantized base
        served = (["--model", str(model), "--allow-quantized-base-adapters"] if model else
                  ["--model", str(model_dir / "hf"), "--dtype", dtype])
        self.cmd = [str(binary or ROOT / ".venv" / "bin" / "loraserve"), "serve", *extra,
                    *served, "--catalog", str(catalog),
                    "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
                    "--device", "cpu", "--torch-threads", str(threads),
                    "--no-prefix-caching",
                    "--max-model-len", str(max_len), "--max-gpu-adapters", str(max(n_adapters, 1)),
                    "--max-lora-rank", "16", "--log-level", "warning"]
        # the batch size stays the server's default (64): a server that cannot batch
        # (`--loraserve-args '--max-batch-size 1'`) is a special mode, labelled as such

    def wait_compiled(self, up_to: int | None = None, timeout: float = 3600) -> list[str]:
        """Until the background compile of the decode step has made every bucket (`/ready`
        lists none `compiling`): what a user's server runs after its first minutes. With
        `up_to`, only the buckets of batches up to that size (those a timed batch of that many
        runs in); the larger ones go on compiling in the background meanwhile, as they do on
        a fresh server. The buckets in use."""
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            body = httpx.get(f"{self.url}/ready", timeout=10).json()
            waiting = [b for b in body.get("compiling", [])
                       if up_to is None or int(re.match(r"batch(\d+)", b).group(1)) <= up_to]
            if not waiting:
                return body.get("compiled", [])
            time.sleep(2)
        raise SystemExit(f"loraserve still compiling after {timeout} s; see {self.log}")

    def body(self, prompt: str, adapter: int | None, tokens: int, check: bool) -> tuple[str, dict]:
        b = {"model": "base" if adapter is None else f"bench/a{adapter:02d}", "prompt": prompt,
             "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        if check:
            b.update(logprobs=0, return_tokens_as_token_ids=True)
        return "/v1/completions", b

    @staticmethod
    def parse(r: dict, check: bool) -> tuple[str, int, list[int] | None]:
        c = r["choices"][0]
        ids = [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]] if check else None
        return c["text"], r["usage"]["completion_tokens"], ids


class LlamaCpp(Server):
    name = "llama.cpp"

    def __init__(self, binary: Path, model_dir: Path, threads: int, n_adapters: int, batch: int,
                 max_len: int, flash_attn: str = "off", dtype: str = "float32",
                 base_file: Path | None = None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        gg, kind = model_dir / "gguf", GGUF_TYPES[dtype]
        base = base_file or gg / f"base-{kind}.gguf"
        if not base.is_file():
            raise SystemExit(f"no {base}: run make_model.py --outtypes f32,{kind}")
        self.cmd = [str(binary), "-m", str(base), "--host", "127.0.0.1",
                    "--port", str(port), "-t", str(threads), "-tb", str(threads),
                    "-np", str(batch), "-c", str(batch * max_len), "-ngl", "0",
                    "-ctk", kind, "-ctv", kind, "--no-cache-prompt", "--cache-ram", "0", "--no-webui"]
        self.cmd += ["-fa", flash_attn]
        if n_adapters:
            # One flag, comma-separated (a repeated --lora keeps only the last). Scale 0 at load:
            # a request without a `lora` field runs with the scales the adapters were loaded with
            # (`--lora-init-without-apply` alone leaves them at 1.0, so the "base" would be all
            # 32 adapters at once).
            self.cmd += ["--lora-init-without-apply", "--lora-scaled", ",".join(
                f"{gg / f'a{i:02d}-{kind}.gguf'}:0.0" for i in range(n_adapters))]

    def body(self, prompt: str, adapter: int | None, tokens: int, check: bool) -> tuple[str, dict]:
        b = {"prompt": prompt, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        if adapter is not None:
            b["lora"] = [{"id": adapter, "scale": 1.0}]
        if check:   # the native endpoint returns the token ids
            b.update(n_predict=tokens, return_tokens=True)
            return "/completion", b
        b.update(model="base", max_tokens=tokens)
        return "/v1/completions", b

    @staticmethod
    def parse(r: dict, check: bool) -> tuple[str, int, list[int] | None]:
        if check:
            return r["content"], r["tokens_predicted"], [int(t) for t in r["tokens"]]
        return r["choices"][0]["text"], r["usage"]["completion_tokens"], None


async def run_batch(server: Server, prompts: list[str], adapters: list[int | None], tokens: int,
                    check: bool) -> tuple[float, list[tuple[str, int, list[int] | None]]]:
    """All requests at once, one connection each (no keep-alive: setup stays inside the timing).
    The client is built before the clock starts."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        async def one(p: str, a: int | None):
            path, body = server.body(p, a, tokens, check)
            r = await client.post(path, json=body)
            if r.status_code != 200:
                raise SystemExit(f"{server.name} {path} -> {r.status_code}: {r.text[:500]}")
            return server.parse(r.json(), check)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters)))
        return time.perf_counter() - t0, list(outs)


def llamacpp_tokenize(server: LlamaCpp, texts: list[str]) -> list[list[int]]:
    import httpx
    return [httpx.post(f"{server.url}/tokenize", json={"content": t, "add_special": False},
                       timeout=30).json()["tokens"] for t in texts]


# ---------------------------------------------------------------------------------------------


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_mix(mix: str, ls_out, lc_out, ref: dict, adapters: list[int | None]) -> list[str]:
    """Mismatch lines (empty: all equal)."""
    bad = []
    for i, ((_, n1, ids1), (_, n2, ids2), a) in enumerate(zip(ls_out, lc_out, adapters)):
        r = ref.get((i, a))
        if ids1 != ids2 or (r is not None and ids1 != r):
            bad.append(f"  {mix} request {i} (adapter {a}): first difference at token "
                       f"ls/lc {first_diff(ids1, ids2)}, ls/ref {first_diff(ids1, r or ids1)}; "
                       f"loraserve {ids1[:8]}... llama.cpp {ids2[:8]}... ref {(r or [])[:8]}...")
    return bad


def divergence(ls_out, lc_out, ref: dict, adapters: list[int | None]) -> str:
    """Per request, the index of the first token where loraserve and llama.cpp, loraserve and the
    reference, llama.cpp and the reference differ ('=' where equal throughout): at bfloat16 a
    greedy output follows the others until a near-tie rounds the other way."""
    def at(a: list[int] | None, b: list[int] | None) -> str:
        if a is None or b is None:
            return "-"
        return "=" if a == b else str(first_diff(a, b))
    cells = []
    for i, ((_, _, ids1), (_, _, ids2), a) in enumerate(zip(ls_out, lc_out, adapters)):
        r = ref.get((i, a))
        cells.append(f"r{i} {at(ids1, ids2)}/{at(ids1, r)}/{at(ids2, r)}")
    return "first difference at token (ls/lc, ls/ref, lc/ref): " + ", ".join(cells)


def main() -> None:
    # a SIGTERM (e.g. from `timeout`) must still run the `finally` that stops both servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".loraserve/llamacpp/h512")
    ap.add_argument("--llama-server", type=Path, default=ROOT / ".loraserve/llamacpp/build/bin/llama-server")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests")
    ap.add_argument("--check-requests", type=int, default=0,
                    help="requests in the correctness step, when more than --batch (all at once: "
                         "llama.cpp runs at most --batch of them together, its -np)")
    ap.add_argument("--llama-flash-attn", default="off", choices=["off", "on", "auto"],
                    help="llama.cpp -fa (default off: its CPU flash attention rounds through "
                         "float16, and greedy outputs then differ from float32 references)")
    ap.add_argument("--dtype", default="float32", choices=list(GGUF_TYPES),
                    help="weights and KV cache on both sides (and the reference): float32, or "
                         "bfloat16/float16 with make_model.py --outtypes f32,bf16/f16")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers + PEFT")
    ap.add_argument("--time-mismatched", action="store_true", help="time mixes with mismatches too")
    ap.add_argument("--logs", type=Path, default=None, help="server logs (default: MODEL_DIR/logs)")
    ap.add_argument("--json", type=Path, default=None, help="write all timings (and the correctness step's token ids) here")
    ap.add_argument("--llama-base", type=Path, default=None,
                    help="the GGUF llama.cpp serves instead of MODEL_DIR/gguf/base-TYPE.gguf, e.g. "
                         "the original quantized file the f32 checkpoint was dequantized from")
    ap.add_argument("--wait-compiled", type=int, default=None, metavar="N",
                    help="time once the decode buckets up to batch N are compiled (default: all "
                         "of them); the rest compile on in the background at the lowest priority")
    ap.add_argument("--no-wait-compiled", action="store_true",
                    help="time at once, as a fresh default server runs (its background compile, "
                         "if any, going on); pair with --freeze-other")
    ap.add_argument("--freeze-other", action="store_true",
                    help="SIGSTOP the other server's process group while one is timed (SIGCONT "
                         "after): an idle server's background work (loraserve's decode-step "
                         "compile runs when its engine is idle) then cannot steal the cores the "
                         "timed one runs on; each server's own background work still counts "
                         "(loraserve's supervisor, frozen with its core, judges the core only "
                         "after a wake of its own following the pause)")
    ap.add_argument("--loraserve-model", type=Path, default=None,
                    help="the model loraserve serves instead of MODEL_DIR/hf, e.g. the original "
                         "quantized GGUF (served quantized, its default; pair with --llama-base)")
    ap.add_argument("--loraserve-args", default="",
                    help="more `loraserve serve` options, e.g. '--compile on'")
    ap.add_argument("--loraserve-bin", type=Path, default=None,
                    help="the `loraserve` executable (default: this checkout's .venv), e.g. a "
                         "wrapper running an older commit, for a before/after run")
    args = ap.parse_args()

    model_dir = args.model_dir.resolve()
    mixes = [m.strip() for m in args.mixes.split(",")]
    n_adapters = max(MIXES[m] for m in mixes)
    n_check = max(args.batch, args.check_requests)
    texts = json.loads((model_dir / "prompts.json").read_text())[:n_check]
    if len(texts) < n_check:
        texts = [texts[i % len(texts)] + f" {i}" for i in range(n_check)]
    logs = (args.logs or model_dir / "logs").resolve()
    logs.mkdir(parents=True, exist_ok=True)

    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "hf" / "tokenizer.json"))
    prompt_ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    max_len = 1 << (max(map(len, prompt_ids)) + args.tokens + 16 - 1).bit_length()
    catalog = ensure_catalog(model_dir, n_adapters)
    ref: dict = {}
    if not args.no_reference:
        pairs = {(i, adapter_of(m, i)) for m in mixes for i in range(n_check)}
        t0 = time.time()
        ref = reference_outputs(model_dir, prompt_ids, pairs, args.tokens, args.dtype)
        print(f"transformers + PEFT reference: {len(pairs)} (prompt, adapter) pairs "
              f"({time.time() - t0:.0f} s, cached in {model_dir}/reference-{args.tokens}"
              f"{'' if args.dtype == 'float32' else '-' + GGUF_TYPES[args.dtype]}.json)")

    print(f"model {model_dir}: prompts {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens, "
          f"{args.batch} requests x {args.tokens} new tokens, reps {args.reps}, {args.dtype}")
    results: dict = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        servers = [LoraServe(model_dir, catalog, threads, n_adapters, args.batch, max_len,
                             args.loraserve_args.split(), args.loraserve_bin, args.dtype,
                             args.loraserve_model),
                   LlamaCpp(args.llama_server, model_dir, threads, n_adapters, args.batch, max_len,
                            args.llama_flash_attn, args.dtype, args.llama_base)]
        for s in servers:
            print(f"[threads {threads}] {s.name}: {' '.join(s.cmd)}")
            s.start(logs / f"{s.name}-t{threads}.log")
        try:
            for s in servers:
                s.wait_ready(300)
            ls, lc = servers
            # timed as it runs once its background compile is done (of every bucket, or with
            # --wait-compiled N of the buckets up to batch N)
            if not args.no_wait_compiled:
                compiled = ls.wait_compiled(args.wait_compiled)
                print(f"[threads {threads}] loraserve decode buckets compiled: {', '.join(compiled) or 'none'}")
            lc_ids = llamacpp_tokenize(lc, texts)
            same_tok = sum(a == b for a, b in zip(lc_ids, prompt_ids))
            print(f"[threads {threads}] prompt tokenization equal in both: {same_tok}/{len(texts)}")
            # 1. correctness (this also pages every adapter in and warms both up)
            expected: dict[str, dict[str, list[str]]] = {}
            timed_mixes = []
            for mix in mixes:
                adapters = [adapter_of(mix, i) for i in range(n_check)]
                _, ls_out = asyncio.run(run_batch(ls, texts, adapters, args.tokens, check=True))
                _, lc_out = asyncio.run(run_batch(lc, texts, adapters, args.tokens, check=True))
                bad = check_mix(mix, ls_out, lc_out, ref, adapters)
                distinct = len({tuple(o[2]) for o in ls_out})
                same_text = sum(a[0] == b[0] for a, b in zip(ls_out, lc_out))
                # the tokenizer.json decoder strips the leading space of a completion's first
                # piece; llama.cpp keeps it. Random weights also emit lone byte-fallback tokens
                # (invalid UTF-8), which the two render differently.
                same_strip = sum(a[0].lstrip(" ") == b[0].lstrip(" ") for a, b in zip(ls_out, lc_out))
                print(f"[threads {threads}] {mix}: token ids equal (loraserve = llama.cpp"
                      f"{' = transformers+PEFT' if ref else ''}) for {n_check - len(bad)}/{n_check} "
                      f"requests; {distinct} distinct outputs; texts equal {same_text}/{n_check} "
                      f"({same_strip} without the leading space)")
                for line in bad[:8]:
                    print(line)
                if bad:
                    print(f"[threads {threads}] {mix}: " + divergence(ls_out, lc_out, ref, adapters))
                expected[mix] = {"loraserve": [o[0] for o in ls_out[:args.batch]],
                                 "llama.cpp": [o[0] for o in lc_out[:args.batch]]}
                entry = results.setdefault(f"t{threads}", {}).setdefault(mix, {})
                entry["mismatches"] = len(bad)
                entry["ids"] = {"loraserve": [o[2] for o in ls_out], "llama.cpp": [o[2] for o in lc_out]}
                if not bad or args.time_mismatched or args.dtype != "float32":
                    timed_mixes.append(mix)
            # warm the OpenAI-compatible path of llama.cpp too (correctness used /completion)
            for mix in timed_mixes:
                adapters = [adapter_of(mix, i) for i in range(args.batch)]
                asyncio.run(run_batch(lc, texts[:args.batch], adapters, args.tokens, check=False))
                asyncio.run(run_batch(ls, texts[:args.batch], adapters, args.tokens, check=False))
            # 2. timing, interleaved
            text_mismatch = {s.name: 0 for s in servers}
            for rep in range(args.reps):
                for k, mix in enumerate(timed_mixes):
                    adapters = [adapter_of(mix, i) for i in range(args.batch)]
                    order = servers if (rep + k) % 2 == 0 else servers[::-1]
                    for s in order:
                        other = servers[1] if s is servers[0] else servers[0]
                        if args.freeze_other:
                            os.killpg(other.proc.pid, signal.SIGSTOP)
                        try:
                            cpu0, busy0 = tree_cpu_seconds(s.proc.pid), machine_busy_seconds()
                            dt, outs = asyncio.run(run_batch(s, texts[:args.batch], adapters, args.tokens,
                                                             check=False))
                            cpu, busy = tree_cpu_seconds(s.proc.pid) - cpu0, machine_busy_seconds() - busy0
                        finally:
                            if args.freeze_other:
                                os.killpg(other.proc.pid, signal.SIGCONT)
                        n = sum(o[1] for o in outs)
                        text_mismatch[s.name] += sum(o[0] != e for o, e in zip(outs, expected[mix][s.name]))
                        r = results[f"t{threads}"][mix]
                        r.setdefault(s.name, []).append(n / dt)
                        r.setdefault(s.name + " cpu_ms_per_token", []).append(1000 * cpu / n)
                        # CPU the rest of the machine (other users, this client) used meanwhile,
                        # in cores: the noise each measurement ran under
                        r.setdefault(s.name + " others_cores", []).append((busy - cpu) / dt)
                print(f"[threads {threads}] round {rep + 1}/{args.reps}: " + ", ".join(
                    f"{m} {rate(results[f't{threads}'][m]['loraserve'][-1])}/"
                    f"{rate(results[f't{threads}'][m]['llama.cpp'][-1])}" for m in timed_mixes)
                    + " tok/s (loraserve/llama.cpp)")
            print(f"[threads {threads}] timed responses whose text differed from step 1: {text_mismatch}")
        finally:
            for s in servers:
                s.stop()

    print()
    print(f"Tokens/s: median (min-max) of {args.reps} interleaved rounds. Ratio: loraserve / llama.cpp "
          f"within each round, median (min-max). CPU: the server's own CPU time (process tree) per "
          f"generated token, median. Others: cores the rest of the machine kept busy meanwhile, median.")
    print()
    print("| threads | mix | loraserve tok/s | llama.cpp tok/s | ratio | CPU ms/token ls / lc | others (cores) |")
    print("|---|---|---|---|---|---|---|")
    med = statistics.median
    for tkey, per_mix in results.items():
        for mix, r in per_mix.items():
            if "loraserve" not in r:
                print(f"| {tkey[1:]} | {mix} | not timed: {r['mismatches']} mismatches | | | | |")
                continue
            a, b = r["loraserve"], r["llama.cpp"]
            ratios = [x / y for x, y in zip(a, b)]
            others = r["loraserve others_cores"] + r["llama.cpp others_cores"]
            print(f"| {tkey[1:]} | {mix} | {rate(med(a))} ({rate(min(a))}-{rate(max(a))}) | "
                  f"{rate(med(b))} ({rate(min(b))}-{rate(max(b))}) | **{med(ratios):.2f}x** "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {med(r['loraserve cpu_ms_per_token']):.2f} / "
                  f"{med(r['llama.cpp cpu_ms_per_token']):.2f} | {med(others):.1f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
