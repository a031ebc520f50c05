"""Training on the real base (SmolLM2-135M-Instruct, GGUF Q4_1) through the Tinker SDK: held-out
gains, cost per step, the train-to-serve handoff, and tenants training at once.

    python bench/train_real.py [--tasks sft,dpo,rl] [--tenants 1,3,8] [--sft-steps 16]
                               [--dpo-steps 10] [--dpo-nll 1] [--rl-steps 10] [--tenant-steps 4]
                               [--smoke]

Starts `loraserve serve --model .venv/models/SmolLM2-135M-Instruct.Q4_1.gguf` on an empty
catalog (`loraserve catalog init`) with `--compile off` (the default compiles the decode step in
the background, which would share the cores with training), `--torch-threads 1` (on the shared
2-core machine two intra-op threads made a training pass about 7x slower: each thread waits for
the other at every op while other jobs hold the cores), `--engine-timeout 300` (a training slice
can take longer than the default 30 s there, and the core would be killed as stalled), and a keys
file with one tenant for the tasks, one per training tenant and one for the chat client; drives it
with the real, unchanged SDK (`mint`, on top of `tinker`). Every task is synthetic, generated with
a fixed seed; held-out prompts are disjoint from the training ones. Per task: the held-out metric
of the base and of the trained adapter (greedy), steps, seconds per step, training tokens/s
(tokens of the datums sent / seconds in the training calls), and the handoff from a save to the
first token of the new revision: `save_weights_and_get_sampling_client()` then a one-token sample
(the RL loop's path), and `save_weights_for_sampler(name)` then a one-token /v1/completions on
`<tenant>/<run>@<name>`.

- sft: "What is 23+45? Answer with the number only." -> "68" (cross_entropy on the answer and
  <|im_end|>); held-out exact match (and the share of bare-number answers: the format).
- dpo: short factual questions ("What is the opposite of hot?"); chosen: the one-word answer
  ("Cold."), rejected: the base's own greedy answer (a sentence); `forward_backward_custom` with
  the DPO loss (beta 0.1), the reference being the base itself: the log-probs of chosen and
  rejected under the base, computed once before training with the base's sampling client
  (`compute_logprobs`). `--dpo-nll W` adds W x the chosen answer's NLL per token (RPO); with
  `--dpo-nll 0` (plain DPO) the answers become one word but mostly wrong ("No."). Held-out: the
  share of greedy answers that are one word (and, of all, one word and right).
- rl: one-word sentiment labels of synthetic reviews; per step `--rl-prompts` prompts (half of
  each label) x `--rl-samples` samples from the current weights (temperature 1), reward 1 when
  the first word is the right label, advantage = reward - the prompt's mean reward (groups with
  one reward for all send nothing), `importance_sampling` (or `--rl-loss ppo`), a new sampler
  after each step; held-out (half of each label): mean reward of greedy answers.
- tenants (`--tenants 1,3,8`): N tenants, each training its own adapter on the sft task
  (`--tenant-steps` steps of `--tenant-batch` examples, then a save and its held-out eval), one
  after another against all at once (a thread each), while another tenant streams 16-token chats
  to the base without pause: wall time of the N jobs (ratio), the mean held-out results of each
  mode, and the chat client's TTFT and inter-token latency p50 / p99 idle, during the sequential
  and during the concurrent jobs.

`--smoke`: 2 steps of each task, tenants 1,3 (6-9 minutes here). The default run: about 21 minutes.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import json
import logging
import math
import os
import random
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx
import torch

os.environ.setdefault("TINKER_TELEMETRY", "0")
import mint  # noqa: E402
from mint import types  # noqa: E402

from loraserve.keys import Principal, append_key  # noqa: E402
from loraserve.model.gguf import resolve_base  # noqa: E402
from loraserve.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."  # shorter than the template's default (45 -> 36 prompt tokens)
logging.getLogger("tinker").setLevel(logging.ERROR)  # "Retrying request ... because of try_again": the long poll
logging.getLogger("mint").setLevel(logging.ERROR)


# -- the server -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    name: str  # the served base
    keys: dict[str, str]  # tenant -> key
    proc: subprocess.Popen
    cmd: list[str]

    def service(self, tenant: str) -> mint.ServiceClient:
        return mint.ServiceClient(base_url=self.url, api_key=self.keys[tenant])

    def http(self, tenant: str, timeout: float = 600) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.keys[tenant]}"})


def start_server(tmp: Path, tenants: list[str], args: argparse.Namespace) -> Server:
    catalog = tmp / "catalog"
    subprocess.run([sys.executable, "-m", "loraserve.cli", "catalog", "init", str(catalog)], check=True,
                   stdout=subprocess.DEVNULL)
    keys_file = tmp / "keys.toml"
    keys = {t: append_key(keys_file, Principal(t, admin=False, tenants=(t,))) for t in tenants}
    port = free_port()
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(args.model), "--catalog", str(catalog),
           "--port", str(port), "--keys", str(keys_file), "--compile", "off",
           "--torch-threads", str(args.torch_threads), "--train-max-tokens", str(args.train_max_tokens),
           "--max-model-len", "512", "--kv-cache-mb", "512", "--engine-timeout", str(args.engine_timeout)]
    log = open(args.server_log or tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"loraserve serve exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.5)
    else:
        proc.kill()
        raise SystemExit("loraserve serve did not become ready in 600 s")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys[tenants[0]]}"}) as h:
        name = h.get("/v1/models").json()["data"][0]["id"]
    return Server(url, name, keys, proc, cmd)


def unload(server: Server, tenant: str, model_id: str) -> None:
    """The SDK's TrainingClient has no unload: its REST route (a future, answered when done)."""
    with server.http(tenant) as h:
        future = h.post("/api/v1/unload_model", json={"model_id": model_id}).json()
        h.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).raise_for_status()


# -- tokens ---------------------------------------------------------------------------------------

TOK: Tokenizer


def prompt_ids(question: str) -> list[int]:
    return TOK.encode(TOK.apply_chat_template([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": question}]))


def answer_ids(text: str) -> list[int]:
    return TOK.encode(text) + [TOK.eos_token_ids[0]]  # <|im_end|>


def supervised(question: str, answer: str) -> tuple[types.Datum, int]:
    """prompt + answer + <|im_end|>, shifted by one, weight 1 on the answer's tokens; and its length."""
    p, a = prompt_ids(question), answer_ids(answer)
    full = p + a
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)})
    return datum, len(full) - 1


def greedy(sampler, questions: list[str], max_tokens: int) -> list[tuple[str, str]]:
    """(text, stop reason) of a greedy answer per question, all in flight at once."""
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(prompt_ids(q)), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=0.0))
               for q in questions]
    out = []
    for f in futures:
        s = f.result().sequences[0]
        out.append((TOK.decode(s.tokens).replace("<|im_end|>", "").strip(), str(s.stop_reason)))
    return out


# -- tasks' data (fixed seeds; held-out prompts disjoint from training) --------------------------

def sft_split(heldout: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    pairs = [(f"What is {a}+{b}? Answer with the number only.", str(a + b))
             for a in range(10, 50) for b in range(10, 50)]
    random.Random(seed).shuffle(pairs)
    return pairs[heldout:], pairs[:heldout]


OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "day": "night", "fast": "slow", "happy": "sad",
             "light": "dark", "open": "closed", "wet": "dry", "old": "young", "hard": "soft", "full": "empty",
             "early": "late", "rich": "poor", "loud": "quiet", "strong": "weak", "high": "low", "thick": "thin",
             "win": "lose", "push": "pull", "inside": "outside", "begin": "end", "buy": "sell", "long": "short",
             "clean": "dirty", "heavy": "light", "first": "last", "true": "false", "left": "right",
             "north": "south", "above": "below", "love": "hate"}
COLORS = {"a banana": "yellow", "grass": "green", "the sky": "blue", "snow": "white", "coal": "black",
          "a tomato": "red", "a carrot": "orange", "milk": "white", "a lemon": "yellow", "a strawberry": "red",
          "a frog": "green", "chocolate": "brown", "a pumpkin": "orange", "an eggplant": "purple",
          "a cucumber": "green", "blood": "red", "a flamingo": "pink", "the sun": "yellow", "a crow": "black",
          "an elephant": "gray", "a polar bear": "white", "a lime": "green", "a cherry": "red",
          "a blueberry": "blue"}
PLURALS = {"cat": "cats", "mouse": "mice", "child": "children", "foot": "feet", "box": "boxes", "man": "men",
           "tooth": "teeth", "city": "cities", "leaf": "leaves", "goose": "geese", "bus": "buses",
           "knife": "knives", "woman": "women", "baby": "babies", "wolf": "wolves", "dish": "dishes",
           "person": "people", "fox": "foxes", "story": "stories", "ox": "oxen", "dog": "dogs", "book": "books",
           "glass": "glasses", "party": "parties"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def dpo_items() -> list[tuple[str, str]]:
    """(question, one-word answer)."""
    items = [(f"What is the opposite of {w}?", o.capitalize()) for w, o in OPPOSITES.items()]
    items += [(f"What color is {t}?", c.capitalize()) for t, c in COLORS.items()]
    items += [(f"What is the plural of {w}?", p.capitalize()) for w, p in PLURALS.items()]
    items += [(f"What day comes after {d}?", DAYS[(i + 1) % 7]) for i, d in enumerate(DAYS)]
    items += [(f"What day comes before {d}?", DAYS[i - 1]) for i, d in enumerate(DAYS)]
    rng = random.Random(1)
    for _ in range(40):
        a, b = rng.sample(range(10, 100), 2)
        items.append((f"Which number is larger, {a} or {b}?", str(max(a, b))))
    return list(dict.fromkeys(items))


def one_word(text: str) -> str | None:
    """The answer's word when `text` is one word (trailing punctuation allowed), else None."""
    t = text.strip().rstrip(".!").strip()
    return t if t and re.fullmatch(r"[A-Za-z0-9'-]+", t) else None


POSITIVE = ["wonderful", "excellent", "delightful", "fantastic", "great", "superb", "lovely", "amazing",
            "outstanding", "pleasant", "brilliant", "perfect"]
NEGATIVE = ["terrible", "awful", "disappointing", "horrible", "dreadful", "poor", "bland", "useless",
            "boring", "rude", "broken", "miserable"]
SUBJECTS = ["The food", "The service", "The movie", "This phone", "The hotel room", "The concert", "The book",
            "Our waiter", "The coffee", "The delivery", "The app", "The hike", "The lecture", "The game",
            "The haircut", "The flight"]


def rl_split(heldout: int, seed: int = 2) -> tuple[list[list[tuple[str, str]]], list[tuple[str, str]]]:
    """(training reviews by label: [positive ones, negative ones], held-out reviews, half of each label)."""
    rng, train, held = random.Random(seed), [], []
    for words, label in ((POSITIVE, "positive"), (NEGATIVE, "negative")):
        items = [(f'Review: "{s} was {w}."\nIs this review positive or negative? Answer with one word.', label)
                 for s in SUBJECTS for w in words]
        rng.shuffle(items)
        held += items[:heldout // 2]
        train.append(items[heldout // 2:])
    return train, held


def label_reward(text: str, label: str) -> float:
    words = re.findall(r"[a-z]+", text.lower())
    return 1.0 if words and words[0] == label else 0.0


# -- a task's report ------------------------------------------------------------------------------

@dataclass
class Report:
    task: str
    metric: str
    before: str
    after: str
    steps: int = 0
    step_s: list[float] = field(default_factory=list)
    train_s: float = 0.0  # in the training calls
    tokens: int = 0  # of the datums sent to the training calls
    handoff_sampler_ms: str = ""
    handoff_v1_ms: str = ""
    notes: str = ""

    def row(self) -> str:
        sps = statistics.median(self.step_s) if self.step_s else float("nan")
        tps = self.tokens / self.train_s if self.train_s else float("nan")
        return (f"| {self.task} | {self.metric} | {self.before} | {self.after} | {self.steps} | {sps:.1f} |"
                f" {tps:.0f} | {self.handoff_sampler_ms} | {self.handoff_v1_ms} | {self.notes} |")


def handoff(server: Server, tenant: str, trainer, probe: str) -> tuple[object, str, str]:
    """(the new revision's sampler, "total (save)" ms from `save_weights_and_get_sampling_client()`
    to its first sampled token, the same from `save_weights_for_sampler` to the first token on /v1)."""
    ids = prompt_ids(probe)
    t0 = time.perf_counter()
    sampler = trainer.save_weights_and_get_sampling_client()
    t1 = time.perf_counter()
    sampler.sample(prompt=types.ModelInput.from_ints(ids), num_samples=1,
                   sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0)).result()
    t2 = time.perf_counter()
    trainer.save_weights_for_sampler("final").result()
    t3 = time.perf_counter()
    with server.http(tenant) as h:
        r = h.post("/v1/completions", json={"model": f"{tenant}/{trainer.model_id}@final", "prompt": ids,
                                            "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
    t4 = time.perf_counter()
    return sampler, f"{(t2 - t0) * 1e3:.0f} ({(t1 - t0) * 1e3:.0f})", f"{(t4 - t2) * 1e3:.0f} ({(t3 - t2) * 1e3:.0f})"


def step(trainer, data: list[types.Datum], loss: str, lr: float) -> float:
    """forward_backward then optim_step (sent back to back, as the SDK pipelines them); loss:sum."""
    fb = trainer.forward_backward(data, loss)
    opt = trainer.optim_step(types.AdamParams(learning_rate=lr))
    out = fb.result()
    opt.result()
    return out.metrics["loss:sum"]


# -- sft ------------------------------------------------------------------------------------------

def sft_accuracy(sampler, heldout: list[tuple[str, str]]) -> tuple[float, float]:
    """(share of answers that are a bare number, share exactly right)."""
    answers = greedy(sampler, [q for q, _ in heldout], 6)
    bare = sum(bool(re.fullmatch(r"\d+", t)) and r == "stop" for t, r in answers)
    return bare / len(heldout), sum(t == a for (t, _), (_, a) in zip(answers, heldout)) / len(heldout)


def sft_train(server: Server, tenant: str, seed: int, steps: int, batch: int, lr: float, rank: int,
              train: list[tuple[str, str]], rep: Report | None = None):
    """A run trained `steps` steps on `batch` examples drawn with `seed`; returns the trainer."""
    trainer = server.service(tenant).create_lora_training_client(base_model=server.name, rank=rank, seed=seed)
    rng = random.Random(1000 + seed)
    for _ in range(steps):
        made = [supervised(q, a) for q, a in rng.sample(train, batch)]
        t0 = time.perf_counter()
        loss = step(trainer, [d for d, _ in made], "cross_entropy", lr)
        if rep is not None:
            dt = time.perf_counter() - t0
            weighted = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d, _ in made)
            print(f"  sft step {rep.steps}: loss/token {loss / weighted:.3f} {dt:.1f}s", flush=True)
            rep.step_s.append(dt)
            rep.train_s += dt
            rep.tokens += sum(n for _, n in made)
            rep.steps += 1
    return trainer


def task_sft(server: Server, args: argparse.Namespace, base) -> Report:
    train, heldout = sft_split(args.heldout)
    questions = [q for q, _ in heldout]
    print(f"  sft: base answers {[t for t, _ in greedy(base, questions[:4], 6)]}", flush=True)
    bare0, exact0 = sft_accuracy(base, heldout)
    rep = Report("sft (cross_entropy)", f"exact match (bare number), {len(heldout)} held-out sums",
                 f"{exact0:.0%} ({bare0:.0%})", "")
    trainer = sft_train(server, "lab", 0, args.sft_steps, args.sft_batch, args.sft_lr, args.rank, train, rep)
    sampler, rep.handoff_sampler_ms, rep.handoff_v1_ms = handoff(server, "lab", trainer, heldout[0][0])
    bare1, exact1 = sft_accuracy(sampler, heldout)
    rep.after = f"{exact1:.0%} ({bare1:.0%})"
    texts = [t for t, _ in greedy(sampler, questions[:6], 6)]
    rep.notes = f"{args.sft_batch} examples/step, lr {args.sft_lr:g}; e.g. {questions[0][8:13]} -> {texts[0]!r}"
    print(f"  sft: held-out exact {exact0:.0%} -> {exact1:.0%}; samples {texts}", flush=True)
    unload(server, "lab", trainer.model_id)
    return rep


# -- dpo ------------------------------------------------------------------------------------------

def dpo_score(sampler, heldout: list[tuple[str, str]]) -> tuple[float, float, list[str]]:
    """(share of one-word answers that ended, share one word and right, the texts)."""
    answers = greedy(sampler, [q for q, _ in heldout], 12)
    one = [one_word(t) if reason == "stop" else None for t, reason in answers]
    right = [w is not None and w.lower() == a.lower() for w, (_, a) in zip(one, heldout)]
    return sum(w is not None for w in one) / len(heldout), sum(right) / len(heldout), [t for t, _ in answers]


def task_dpo(server: Server, args: argparse.Namespace, base) -> Report:
    items = dpo_items()
    random.Random(3).shuffle(items)
    heldout, train = items[:args.heldout], items[args.heldout:]
    rng = random.Random(4)
    rng.shuffle(train)
    train = train[:args.dpo_steps * args.dpo_batch * 3 // 2 + 4]  # spares for answers that are one word
    t0 = time.perf_counter()  # rejected: the base's own greedy answer (up to 24 tokens) where it is not one word
    rejected = [f.result().sequences[0].tokens for f in [
        base.sample(prompt=types.ModelInput.from_ints(prompt_ids(q)), num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=24, temperature=0.0)) for q, _ in train]]
    kept = [(qa, list(r)) for qa, r in zip(train, rejected) if one_word(TOK.decode(r)) is None]
    kept = kept[:args.dpo_steps * args.dpo_batch]  # the pairs the steps use (each once)
    pairs = []  # per pair: (tokens, response mask, prompt length) of chosen, then rejected
    for (q, a), r in kept:
        p = prompt_ids(q)
        seqs = []
        for response in (answer_ids(a + "."), r):
            full = p + response
            mask = [0.0] * (len(p) - 1) + [1.0] * len(response)
            seqs.append((full, mask, len(p)))
        pairs.append(seqs)
    if len(pairs) < args.dpo_steps * args.dpo_batch:
        raise SystemExit(f"dpo: only {len(pairs)} preference pairs for {args.dpo_steps} x {args.dpo_batch}")
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # the reference: the base's log-probs of each response, computed once
    futures = [[base.compute_logprobs(types.ModelInput.from_ints(full)) for full, _, _ in seqs] for seqs in pairs]
    refs = [[sum(f.result()[n:]) for f, (_, _, n) in zip(fs, seqs)] for fs, seqs in zip(futures, pairs)]
    ref_s = time.perf_counter() - t0
    one0, right0, texts = dpo_score(base, heldout)
    print(f"  dpo: base answers {texts[:4]}", flush=True)
    name = "dpo (forward_backward_custom" + (f", + chosen NLL x {args.dpo_nll:g})" if args.dpo_nll else ")")
    rep = Report(name, f"one-word answers (and right), {len(heldout)} held-out",
                 f"{one0:.0%} ({right0:.0%})", "")
    trainer = server.service("lab").create_lora_training_client(base_model=server.name, rank=args.rank, seed=0)
    beta = args.dpo_beta
    first_gap = None
    for s in range(args.dpo_steps):
        idx = range(s * args.dpo_batch, (s + 1) * args.dpo_batch)
        data, masks, ref = [], [], []
        for i in idx:
            for (full, mask, _), r in zip(pairs[i], refs[i]):
                data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                        loss_fn_inputs={"target_tokens": full[1:], "weights": mask}))
                masks.append(torch.tensor(mask))
                ref.append(r)

        def dpo_loss(_data, logprobs_list):
            pol = [(lp * m).sum() for lp, m in zip(logprobs_list, masks)]
            losses, wins = [], 0
            for k in range(0, len(pol), 2):
                margin = beta * ((pol[k] - ref[k]) - (pol[k + 1] - ref[k + 1]))
                # --dpo-nll: RPO's NLL of the chosen response per token (0: plain DPO)
                nll = -pol[k] / masks[k].sum() * args.dpo_nll
                losses.append(-torch.nn.functional.logsigmoid(margin) + nll)
                wins += float(margin.detach()) > 0
            gap = max(abs(float(p.detach()) - r) for p, r in zip(pol, ref))
            return torch.stack(losses).mean(), {"dpo:loss": float(torch.stack(losses).mean()),
                                                "dpo:win": wins / len(losses), "dpo:ref_gap": gap}

        t0 = time.perf_counter()
        out = trainer.forward_backward_custom(data, dpo_loss).result()
        trainer.optim_step(types.AdamParams(learning_rate=args.dpo_lr)).result()
        dt = time.perf_counter() - t0
        if first_gap is None:
            first_gap = out.metrics["dpo:ref_gap"]  # policy = base at step 0: the reference's own error
        rep.step_s.append(dt)
        rep.train_s += dt
        rep.tokens += 2 * sum(len(d.model_input.to_ints()) for d in data)  # a forward, then a forward_backward
        rep.steps += 1
        print(f"  dpo step {s}: loss {out.metrics['dpo:loss']:.3f} win {out.metrics['dpo:win']:.2f} {dt:.1f}s",
              flush=True)
    sampler, rep.handoff_sampler_ms, rep.handoff_v1_ms = handoff(server, "lab", trainer, heldout[0][0])
    one1, right1, texts = dpo_score(sampler, heldout)
    rep.after = f"{one1:.0%} ({right1:.0%})"
    rep.notes = (f"{args.dpo_batch} pairs/step, beta {beta:g}, lr {args.dpo_lr:g}; rejected: the base's own "
                 f"answers, {len(pairs)} made in {gen_s:.0f} s; reference log-probs in {ref_s:.0f} s, "
                 f"|policy - reference| at step 0 {first_gap:.1e} nats")
    print(f"  dpo: held-out one-word {one0:.0%} -> {one1:.0%}; samples {texts[:6]}", flush=True)
    unload(server, "lab", trainer.model_id)
    return rep


# -- rl -------------------------------------------------------------------------------------------

def rl_reward(sampler, heldout: list[tuple[str, str]]) -> tuple[float, list[str]]:
    answers = greedy(sampler, [q for q, _ in heldout], 4)
    return sum(label_reward(t, a) for (t, _), (_, a) in zip(answers, heldout)) / len(heldout), \
        [t for t, _ in answers]


def task_rl(server: Server, args: argparse.Namespace, base) -> Report:
    train, heldout = rl_split(args.heldout)
    before, texts = rl_reward(base, heldout)
    print(f"  rl: base answers {texts[:4]}", flush=True)
    rep = Report(f"rl ({args.rl_loss})", f"mean reward, {len(heldout)} held-out reviews (half positive)",
                 f"{before:.2f}", "")
    trainer = server.service("lab").create_lora_training_client(base_model=server.name, rank=args.rank, seed=0)
    rng = random.Random(5)
    sampler = base  # B = 0: the run's weights are the base's
    sent, rewards_seen = 0, []
    for s in range(args.rl_steps):
        t_iter = time.perf_counter()
        half = args.rl_prompts // 2
        batch = rng.sample(train[0], half) + rng.sample(train[1], args.rl_prompts - half)
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(prompt_ids(q)), num_samples=args.rl_samples,
                                  sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0,
                                                                       seed=rng.randrange(1 << 30)))
                   for q, _ in batch]
        data, mean_r = [], []
        for f, (q, label) in zip(futures, batch):
            seqs = f.result().sequences
            rs = [label_reward(TOK.decode(x.tokens), label) for x in seqs]
            mean = sum(rs) / len(rs)
            mean_r.append(mean)
            if max(rs) == min(rs):
                continue  # no signal in this group
            p = prompt_ids(q)
            for x, r in zip(seqs, rs):
                full = p + list(x.tokens)
                n = len(p) - 1
                inputs = {"target_tokens": full[1:], "logprobs": [0.0] * n + list(x.logprobs),
                          "advantages": [0.0] * n + [r - mean] * len(x.tokens)}
                data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs))
        rewards_seen.append(sum(mean_r) / len(mean_r))
        t0 = time.perf_counter()
        if data:
            step(trainer, data, args.rl_loss, args.rl_lr)
            rep.train_s += time.perf_counter() - t0
            rep.tokens += sum(len(d.model_input.to_ints()) for d in data)
            sent += len(data)
            sampler = trainer.save_weights_and_get_sampling_client()
        rep.step_s.append(time.perf_counter() - t_iter)
        rep.steps += 1
        print(f"  rl step {s}: train reward {rewards_seen[-1]:.2f}, {len(data)} datums, "
              f"{time.perf_counter() - t_iter:.1f}s", flush=True)
    sampler, rep.handoff_sampler_ms, rep.handoff_v1_ms = handoff(server, "lab", trainer, heldout[0][0])
    after, texts = rl_reward(sampler, heldout)
    rep.after = f"{after:.2f}"
    rep.notes = (f"{args.rl_prompts} prompts x {args.rl_samples} samples/step, lr {args.rl_lr:g}, {sent} datums "
                 f"sent; train reward {rewards_seen[0]:.2f} -> {rewards_seen[-1]:.2f}; s/step includes sampling")
    print(f"  rl: held-out reward {before:.2f} -> {after:.2f}; samples {texts[:3] + texts[-3:]}", flush=True)
    unload(server, "lab", trainer.model_id)
    return rep


# -- tenants training at once, a chat client streaming meanwhile ---------------------------------

class Chats:
    """One client streaming greedy chats to the base without pause, each labelled with the phase
    it started and ended in (a chat spanning two phases is dropped)."""

    def __init__(self, server: Server, tenant: str, tokens: int):
        self.server, self.tenant, self.tokens = server, tenant, tokens
        self.phase, self.stop = "warm-up", threading.Event()
        self.samples: dict[str, tuple[list[float], list[float]]] = {}
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        rng = random.Random(7)
        topics = ["the sea", "a city", "music", "trees", "the moon", "bread", "winter", "trains"]
        with self.server.http(self.tenant) as http:
            while not self.stop.is_set():
                phase = self.phase
                body = {"model": self.server.name, "stream": True, "temperature": 0, "ignore_eos": True,
                        "max_tokens": self.tokens,
                        "messages": [{"role": "user", "content": f"Tell me about {rng.choice(topics)}."}]}
                t0, stamps = time.perf_counter(), []
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            choices = json.loads(line[6:]).get("choices") or [{}]
                            if choices[0].get("delta", {}).get("content"):
                                stamps.append(time.perf_counter())
                if stamps and phase == self.phase:
                    ttft, itl = self.samples.setdefault(phase, ([], []))
                    ttft.append(stamps[0] - t0)
                    itl += [b - a for a, b in zip(stamps, stamps[1:])]
                time.sleep(rng.uniform(0, 0.05))

    def count(self, phase: str) -> int:
        return len(self.samples.get(phase, ([], []))[0])


def pct(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] * 1e3 if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1e3


def tenant_job(server: Server, i: int, args: argparse.Namespace, train, heldout, out: dict) -> None:
    tenant = f"t{i}"
    t0 = time.perf_counter()
    trainer = sft_train(server, tenant, i, args.tenant_steps, args.tenant_batch, args.tenant_lr, args.rank, train)
    t1 = time.perf_counter()
    sampler = trainer.save_weights_and_get_sampling_client()
    t2 = time.perf_counter()
    out[i] = (sft_accuracy(sampler, heldout), time.perf_counter() - t0, t1 - t0, t2 - t1)
    unload(server, tenant, trainer.model_id)


def tenants_part(server: Server, args: argparse.Namespace, counts: list[int]) -> tuple[list[str], list[str]]:
    train, heldout = sft_split(args.heldout)
    heldout = heldout[:args.tenant_heldout]
    chats = Chats(server, "chat", args.chat_tokens)
    chats.thread.start()
    for phase, n in (("warm-up", 2), ("idle", args.idle_chats)):
        chats.phase = phase
        while chats.count(phase) < n:
            if not chats.thread.is_alive():
                raise SystemExit("the chat client failed")
            time.sleep(0.2)
    rows = []
    for n in counts:
        res = {}
        for mode in ("one after another", "at once"):
            chats.phase = f"{n} {mode}"
            out: dict[int, tuple] = {}  # tenant -> ((bare, exact), job s, training s, save s)
            t0 = time.perf_counter()
            if mode == "at once":
                threads = [threading.Thread(target=tenant_job, args=(server, i, args, train, heldout, out))
                           for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                for i in range(n):
                    tenant_job(server, i, args, train, heldout, out)
            wall = time.perf_counter() - t0
            if len(out) != n:
                raise SystemExit(f"{n} tenants {mode}: only {len(out)} jobs finished")
            res[mode] = (wall, [out[i][0] for i in range(n)])
            print(f"  {n} tenants {mode}: {wall:.1f} s, held-out (bare number, exact) "
                  f"{[f'{b:.0%} {e:.0%}' for b, e in res[mode][1]]}; per job seconds: all / training / save "
                  f"{[f'{out[i][1]:.0f}/{out[i][2]:.0f}/{out[i][3]:.1f}' for i in range(n)]}", flush=True)
        (ws, accs), (wc, accc) = res["one after another"], res["at once"]

        def mean(accs):
            return f"{statistics.mean(b for b, _ in accs):.0%} / {statistics.mean(e for _, e in accs):.0%}"

        rows.append(f"| {n} | {args.tenant_steps} x {args.tenant_batch} | {ws:.1f} | {wc:.1f} | {ws / wc:.2f}x |"
                    f" {mean(accs)} | {mean(accc)} |"
                    f" {max(abs(a[1] - b[1]) for a, b in zip(accs, accc)):.0%} |")
    chats.phase = "done"
    chats.stop.set()
    chats.thread.join(timeout=120)
    idle_ttft, idle_itl = chats.samples["idle"]
    lat = []
    for phase in ["idle"] + [f"{n} {m}" for n in counts for m in ("one after another", "at once")]:
        ttft, itl = chats.samples.get(phase, ([], []))

        def cell(xs, base, q):
            v = pct(xs, q)
            return f"{v:.0f}" if phase == "idle" else f"{v:.0f} ({v / pct(base, q):.1f}x)"

        lat.append(f"| {phase} | {len(ttft)} | {cell(ttft, idle_ttft, 50)} | {cell(ttft, idle_ttft, 99)} |"
                   f" {cell(itl, idle_itl, 50)} | {cell(itl, idle_itl, 99)} | {max(itl or [math.nan]) * 1e3:.0f} |")
    return rows, lat


# -- main -----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=GGUF)
    ap.add_argument("--tasks", default="sft,dpo,rl")
    ap.add_argument("--tenants", default="1,3,8", help="tenant counts of the multi-tenant part ('' skips it)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--heldout", type=int, default=32, help="held-out prompts per task")
    ap.add_argument("--sft-steps", type=int, default=16)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--dpo-steps", type=int, default=10)
    ap.add_argument("--dpo-batch", type=int, default=4, help="preference pairs per step")
    ap.add_argument("--dpo-lr", type=float, default=5e-4)
    ap.add_argument("--dpo-beta", type=float, default=0.1)
    ap.add_argument("--dpo-nll", type=float, default=1.0,
                    help="weight of the chosen response's NLL per token added to the DPO loss (RPO); 0: plain DPO")
    ap.add_argument("--rl-steps", type=int, default=10)
    ap.add_argument("--rl-prompts", type=int, default=4)
    ap.add_argument("--rl-samples", type=int, default=4)
    ap.add_argument("--rl-lr", type=float, default=1e-3)
    ap.add_argument("--rl-loss", default="importance_sampling", choices=["importance_sampling", "ppo"])
    ap.add_argument("--tenant-steps", type=int, default=4)
    ap.add_argument("--tenant-batch", type=int, default=4)
    ap.add_argument("--tenant-lr", type=float, default=2e-3)
    ap.add_argument("--tenant-heldout", type=int, default=16)
    ap.add_argument("--idle-chats", type=int, default=10)
    ap.add_argument("--chat-tokens", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--train-max-tokens", type=int, default=256)
    ap.add_argument("--engine-timeout", type=float, default=300,
                    help="a training slice of 256 tokens on the loaded 2-core machine can pass the default 30 s")
    ap.add_argument("--server-log", type=Path)
    ap.add_argument("--smoke", action="store_true", help="2 steps of each task, tenants 1,3")
    args = ap.parse_args()
    if args.smoke:
        args.sft_steps = args.dpo_steps = args.rl_steps = args.tenant_steps = 2
        args.heldout, args.tenant_heldout, args.idle_chats = 8, 4, 3
        args.tenants = "1,3" if args.tenants == "1,3,8" else args.tenants
    global TOK
    TOK = Tokenizer.from_dir(resolve_base(args.model))
    tasks = [t for t in args.tasks.split(",") if t]
    counts = [int(x) for x in args.tenants.split(",") if x]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        server = start_server(Path(tmp), ["lab", "chat", *[f"t{i}" for i in range(max(counts, default=0))]], args)
        print(f"server ready in {time.perf_counter() - t0:.0f} s: "
              f"{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(server.cmd[1:]))}", flush=True)
        print("  (--compile off: the default compiles the decode step in the background, sharing the cores "
              "with training; --torch-threads 1: see the docstring)", flush=True)
        try:
            rows, tenant_rows, lat = [], [], []
            base = server.service("lab").create_sampling_client(base_model=server.name)
            for task in tasks:
                t0 = time.perf_counter()
                rep = {"sft": task_sft, "dpo": task_dpo, "rl": task_rl}[task](server, args, base)
                rows.append(rep.row())
                print(f"{task} done in {time.perf_counter() - t0:.0f} s", flush=True)
            if counts:
                t0 = time.perf_counter()
                tenant_rows, lat = tenants_part(server, args, counts)
                print(f"tenants done in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            server.proc.terminate()
            try:
                server.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.proc.kill()
    print(f"\ntotal {time.perf_counter() - started:.0f} s\n")
    if rows:
        print("| task | held-out metric | before | after | steps | s/step (median) | training tokens/s |"
              " handoff: sampler save -> first token, ms (the save) |"
              " handoff: named save -> /v1 first token, ms (the save) |"
              " notes |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    if tenant_rows:
        print(f"\n| tenants | steps x examples each | one after another (s) | at once (s) | ratio |"
              f" held-out bare number / exact match, one after another (mean) | at once (mean) |"
              " largest per-tenant difference (exact) |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(tenant_rows))
        print(f"\n| chat client ({args.chat_tokens}-token streamed chats to the base) during | chats |"
              " TTFT p50 (ms) | TTFT p99 (ms) | inter-token p50 (ms) | inter-token p99 (ms) | longest gap (ms) |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(lat))


if __name__ == "__main__":
    main()
