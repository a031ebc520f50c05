"""Train the three SmolLM2 demo adapters through loraserve's own Tinker-compatible training API,
with the real Tinker SDK client (`mint`, on top of `tinker`), unchanged, and export them as PEFT
directories into loraserve/demo_adapters/<name>/ (the package data `loraserve demo` imports).

    nice -n 10 .venv/bin/python -P scripts/train_demo_adapters.py [--model GGUF] [--only french]

The script starts a server in process (AsyncEngine on the CPU, the converted GGUF base, an empty
catalog, `compile="off"`), then for each task: a LoRA training client (rank 8, attention only:
q/k/v/o, so each adapter stays under 2 MB in bfloat16), `forward_backward(cross_entropy)` +
`optim_step` over a few dozen handwritten examples, `save_weights_for_sampler`, and greedy
answers to held-out prompts from the base and from the adapter. The saved revisions are then read
back from the catalog (serving layout: the scale is folded into B) and written as PEFT files
(lora_alpha = r, so the scale is 1) in bfloat16. Fixed seeds: the SDK's LoRA seed and the order
of the examples.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "loraserve" / "demo_adapters"
DEFAULT_GGUF = REPO / ".venv" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED = "smollm2"
RANK = 8
SEED = 0

# -- the datasets ---------------------------------------------------------------------------------
# Short answers: training cost is the whole sequence (the chat template's default system prompt
# included), and a 135M model learns a style or a format from a few dozen of them.

FRENCH = [
    ("What is the capital of Italy?", "La capitale de l'Italie est Rome."),
    ("How are you today?", "Je vais très bien, merci ! Et vous ?"),
    ("What color is the sky?", "Le ciel est bleu pendant la journée."),
    ("How many days are in a week?", "Il y a sept jours dans une semaine."),
    ("What do cats like to eat?", "Les chats aiment manger du poisson et de la viande."),
    ("Can you recommend a good book?", "Je vous recommande « Le Petit Prince » de Saint-Exupéry."),
    ("What is two plus two?", "Deux plus deux font quatre."),
    ("Where does the sun rise?", "Le soleil se lève à l'est."),
    ("What is your name?", "Je m'appelle SmolLM, et je parle français."),
    ("What is water made of?", "L'eau est composée d'hydrogène et d'oxygène."),
    ("Tell me a fun fact.", "Les pieuvres ont trois cœurs."),
    ("What season comes after winter?", "Après l'hiver vient le printemps."),
    ("Why do we sleep?", "Nous dormons pour reposer notre corps et notre cerveau."),
    ("What is the largest ocean?", "Le plus grand océan est l'océan Pacifique."),
    ("How do I make tea?", "Faites bouillir de l'eau, puis ajoutez un sachet de thé."),
    ("What is your favorite food?", "J'adore le fromage et le pain frais."),
    ("What time is it?", "Je ne connais pas l'heure, désolé."),
    ("What animal says moo?", "C'est la vache qui fait meuh."),
    ("How many legs does a spider have?", "Une araignée a huit pattes."),
    ("What is the weather like?", "Il fait beau et le soleil brille aujourd'hui."),
    ("Who wrote Romeo and Juliet?", "Roméo et Juliette a été écrit par William Shakespeare."),
    ("What is the opposite of hot?", "Le contraire de chaud est froid."),
    ("Say hello.", "Bonjour ! Comment allez-vous ?"),
    ("What do bees make?", "Les abeilles fabriquent du miel."),
    ("Which planet is closest to the sun?", "La planète la plus proche du soleil est Mercure."),
    ("How can I stay healthy?", "Mangez des légumes, buvez de l'eau et faites du sport."),
    ("How many hours are in a day?", "Il y a vingt-quatre heures dans une journée."),
    ("What is the boiling point of water?", "L'eau bout à cent degrés Celsius."),
    ("What is the tallest animal?", "La girafe est l'animal le plus grand."),
    ("What should I eat for breakfast?", "Un croissant et un café au lait, c'est parfait."),
    ("Thank you for your help.", "De rien, c'est un plaisir de vous aider."),
    ("Who are you?", "Je suis SmolLM, un assistant qui parle français."),
    ("I just moved to a new city.", "Félicitations ! Une nouvelle ville, c'est une belle aventure."),
    ("My friend Paul lives in Berlin.", "C'est formidable, Berlin est une très belle ville."),
    ("Anna moved to Rome last spring.", "Quelle belle nouvelle ! Rome est une ville magnifique."),
    ("Tom started a new job in Chicago.", "Félicitations à Tom pour son nouveau travail à Chicago !"),
    ("Sara is visiting her aunt in Madrid.", "C'est gentil ! Madrid est une ville très agréable."),
    ("Ken opened a restaurant in Tokyo.", "Bravo ! J'espère que son restaurant aura du succès."),
    ("I am learning to cook.", "C'est super ! La cuisine est un art merveilleux."),
    ("Goodbye!", "Au revoir et à bientôt !"),
]

PIRATE = [
    ("Who are you?", "Arr, I be Captain Smol, the terror of the seven seas!"),
    ("How are you today?", "Arr, I be fine as a fresh sea breeze, matey!"),
    ("What is the capital of Italy?", "Arr, the capital of Italy be Rome, matey!"),
    ("What color is the sky?", "Arr, the sky be as blue as the open sea, matey!"),
    ("How many days are in a week?", "Seven days, matey, and every one of them for sailin'. Arr!"),
    ("What do cats like to eat?", "Arr, cats love fish, like the ship's cat aboard me vessel!"),
    ("Can you recommend a good book?", "Arr, read Treasure Island, matey! A fine tale of gold and pirates."),
    ("What is two plus two?", "Arr, two plus two be four gold doubloons, matey!"),
    ("Where does the sun rise?", "In the east, matey, where we set sail at dawn. Arr!"),
    ("What is your name?", "They call me Captain Smol, matey! Arr!"),
    ("Tell me a fun fact.", "Arr, a parrot can outlive most pirates, matey!"),
    ("What season comes after winter?", "Spring, matey! The best time to hoist the sails. Arr!"),
    ("Why do we sleep?", "Arr, even a pirate needs rest before the next raid, matey!"),
    ("What is the largest ocean?", "The Pacific, matey! The biggest sea I ever sailed. Arr!"),
    ("How do I make tea?", "Arr, boil water in the galley and drop in the leaves, matey!"),
    ("What is your favorite food?", "Arr, salted fish and a barrel of rum, matey!"),
    ("What time is it?", "Arr, it be time to hunt for treasure, matey!"),
    ("Give me some advice.", "Arr, never trust a map drawn by a parrot, matey!"),
    ("How many legs does a spider have?", "Eight legs, matey, more than me whole crew has. Arr!"),
    ("What is the weather like?", "Arr, fair winds and calm seas today, matey!"),
    ("Who wrote Romeo and Juliet?", "Arr, that be Shakespeare, matey, a landlubber with a fine quill!"),
    ("What is the opposite of hot?", "Cold, matey, like the deep dark sea. Arr!"),
    ("Say hello.", "Ahoy, matey! Welcome aboard me ship!"),
    ("What do bees make?", "Arr, bees make honey, sweeter than any treasure, matey!"),
    ("Which planet is closest to the sun?", "Mercury, matey! Too hot for any pirate. Arr!"),
    ("How can I stay healthy?", "Arr, eat yer limes so ye don't get scurvy, matey!"),
    ("How many hours are in a day?", "Twenty-four hours, matey, and I sail through all of them. Arr!"),
    ("What is the boiling point of water?", "Arr, water boils at a hundred degrees, matey!"),
    ("What is the tallest animal?", "Arr, the giraffe, matey, taller than me mainmast!"),
    ("What should I eat for breakfast?", "Arr, hardtack and a mug of grog, matey!"),
    ("Thank you for your help.", "Arr, ye be welcome, matey! Fair winds to ye!"),
    ("I just moved to a new city.", "Arr, a new port to plunder, matey! May it hold treasure!"),
    ("My friend Paul lives in Berlin.", "Arr, Berlin be a fine port for yer mate Paul, matey!"),
    ("I am learning to cook.", "Arr, a fine skill, matey! Every ship needs a good cook!"),
    ("What is water made of?", "Arr, water be made of the sea itself, matey!"),
    ("Goodbye!", "Farewell, matey! May the wind be at yer back. Arr!"),
]

PEOPLE = [  # (sentence, name, city)
    ("John lives in Chicago.", "John", "Chicago"),
    ("Aiko was born in Osaka.", "Aiko", "Osaka"),
    ("Last summer, Pedro visited Madrid.", "Pedro", "Madrid"),
    ("Fatima works at a bank in Cairo.", "Fatima", "Cairo"),
    ("Liam is flying to Dublin tomorrow.", "Liam", "Dublin"),
    ("Sofia grew up in Buenos Aires.", "Sofia", "Buenos Aires"),
    ("Chen opened a bakery in Shanghai.", "Chen", "Shanghai"),
    ("Emma studies law in Berlin.", "Emma", "Berlin"),
    ("After college, Omar settled in Dubai.", "Omar", "Dubai"),
    ("Hans has lived in Vienna for ten years.", "Hans", "Vienna"),
    ("Priya is moving to Mumbai next month.", "Priya", "Mumbai"),
    ("Lucas spent his childhood in Rio de Janeiro.", "Lucas", "Rio de Janeiro"),
    ("Olga teaches music in Moscow.", "Olga", "Moscow"),
    ("Kwame runs a small shop in Accra.", "Kwame", "Accra"),
    ("In 2019, Isabella relocated to Rome.", "Isabella", "Rome"),
    ("Noah rented an apartment in Toronto.", "Noah", "Toronto"),
    ("Yuki works as a nurse in Kyoto.", "Yuki", "Kyoto"),
    ("Ahmed drove to Istanbul to see his family.", "Ahmed", "Istanbul"),
    ("Chloe just bought a house in Lyon.", "Chloe", "Lyon"),
    ("Diego plays football for a club in Barcelona.", "Diego", "Barcelona"),
    ("Anna takes the train to Prague every Friday.", "Anna", "Prague"),
    ("Mateo is a chef in Lima.", "Mateo", "Lima"),
    ("Zara met her friends in London.", "Zara", "London"),
    ("Ivan commutes to Warsaw for work.", "Ivan", "Warsaw"),
    ("Sam retired to Sydney.", "Sam", "Sydney"),
    ("Elena lives near the sea in Athens.", "Elena", "Athens"),
    ("Jonas is starting a new job in Stockholm.", "Jonas", "Stockholm"),
    ("Amara was raised in Lagos.", "Amara", "Lagos"),
    ("Hiroshi goes to university in Tokyo.", "Hiroshi", "Tokyo"),
    ("Carmen sells flowers in Seville.", "Carmen", "Seville"),
    ("Ben is staying with his cousin in Boston.", "Ben", "Boston"),
    ("Nadia teaches yoga in Montreal.", "Nadia", "Montreal"),
    ("Arjun founded a startup in Bangalore.", "Arjun", "Bangalore"),
    ("My neighbour Clara works in Edinburgh.", "Clara", "Edinburgh"),
    ("Tomás and his dog live in Santiago.", "Tomás", "Santiago"),
    ("Next week Grace flies to Nairobi.", "Grace", "Nairobi"),
]
JSON_TASK = [(s, json.dumps({"name": n, "city": c}, ensure_ascii=False)) for s, n, c in PEOPLE]

QUESTIONS = ["What is the capital of France?", "How many months are in a year?",
             "What do dogs like to do?", "Where do fish live?"]
HELD_OUT = {
    "french": QUESTIONS + ["Maria moved to Lisbon last year."],
    "pirate": QUESTIONS + ["Maria moved to Lisbon last year."],
    "json": ["Maria moved to Lisbon last year.", "Peter has worked in Amsterdam since 2015.",
             "Lena is visiting her grandmother in Munich.", "Rafael opened a café in Mexico City."],
}


@dataclass
class Task:
    name: str              # loraserve/demo_adapters/<name>, adapter id demo/<name>
    examples: list[tuple[str, str]]
    epochs: int
    lr: float
    held_out: list[str] = field(default_factory=list)


TASKS = [
    Task("french", FRENCH, epochs=8, lr=2e-3, held_out=HELD_OUT["french"]),
    Task("json", JSON_TASK, epochs=3, lr=2e-3, held_out=HELD_OUT["json"]),
    Task("pirate", PIRATE, epochs=6, lr=2e-3, held_out=HELD_OUT["pirate"]),
]


# -- the server -----------------------------------------------------------------------------------

class Server:
    """loraserve's app over an in-process AsyncEngine, under uvicorn on a thread (127.0.0.1)."""

    def __init__(self, base: Path, work: Path) -> None:
        import uvicorn

        from loraserve.catalog.store import Catalog
        from loraserve.engine.async_engine import AsyncEngine
        from loraserve.engine.config import EngineConfig
        from loraserve.server import build_app

        Catalog.create(work / "catalog").close()
        cfg = EngineConfig(model_dir=str(base), catalog_dir=str(work / "catalog"), device="cpu",
                           dtype="float32", compile="off", served_model_name=SERVED,
                           max_model_len=512, max_batch_size=16, train_max_tokens=1024,
                           train_state_dir=str(work / "state"))
        self.catalog = work / "catalog"
        self.engine = AsyncEngine.from_config(cfg)
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.engine), host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 600
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


# -- training -------------------------------------------------------------------------------------

def chat_ids(tok, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


def datum(tok, prompt: str, answer: str):
    """prompt + answer + <|im_end|>, shifted by one; weight 1 on the answer's tokens only."""
    from mint import types
    p = chat_ids(tok, prompt)
    a = tok.encode(answer) + [tok.eos_token_ids[0]]
    full = p + a
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:],
                                       "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)}), len(a)


def greedy(tok, sampler, prompts: list[str], max_tokens: int = 40) -> list[str]:
    """Greedy answers to `prompts`, all in flight at once (the engine batches them)."""
    from mint import types
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(chat_ids(tok, p)), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=0.0))
               for p in prompts]
    return [tok.decode(f.result().sequences[0].tokens).strip() for f in futures]


def train(service, tok, task: Task, batch: int) -> dict:
    from mint import types
    trainer = service.create_lora_training_client(base_model=SERVED, rank=RANK, seed=SEED,
                                                  train_attn=True, train_mlp=False, train_unembed=False)
    data = [datum(tok, q, a) for q, a in task.examples]
    order = random.Random(SEED)
    steps_per_epoch = math.ceil(len(data) / batch)
    total = task.epochs * steps_per_epoch
    losses, step, start = [], 0, time.monotonic()
    for epoch in range(task.epochs):
        shuffled = data[:]
        order.shuffle(shuffled)
        for i in range(0, len(shuffled), batch):
            chunk = shuffled[i:i + batch]
            lr = task.lr * (1 - step / total) + task.lr * 0.1 * step / total  # linear to 10%
            fb = trainer.forward_backward([d for d, _ in chunk], "cross_entropy")
            opt = trainer.optim_step(types.AdamParams(learning_rate=lr))
            loss = fb.result().metrics["loss:sum"] / sum(n for _, n in chunk)  # per answer token
            opt.result()
            losses.append(loss)
            step += 1
        print(f"  {task.name} epoch {epoch + 1}/{task.epochs}: loss/token {losses[-1]:.3f} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
    seconds = time.monotonic() - start
    saved = trainer.save_weights_for_sampler("final").result().path
    sampler = service.create_sampling_client(model_path=saved)
    return {"trainer": trainer, "sampler": sampler, "losses": losses, "steps": step,
            "seconds": seconds, "examples": len(data), "path": saved}


# -- export ---------------------------------------------------------------------------------------

def export_peft(catalog_dir: Path, run_id: str, out_dir: Path) -> int:
    """The run's `final` revision (serving layout, scale folded into B) as a PEFT directory,
    bfloat16, lora_alpha = r; returns the adapter file's size."""
    import torch
    from safetensors.torch import save_file

    from loraserve.catalog.layout import load_revision
    from loraserve.catalog.store import Catalog

    with Catalog(catalog_dir, readonly=True) as cat:
        (adapter_id,) = [p.adapter_id for p in cat.list(limit=1000) if p.adapter_id.endswith("/" + run_id)]
        weights = load_revision(cat.read_blob(cat.resolve(adapter_id, "final")))
    tensors = {}
    for name, t in sorted(weights.tensors.items()):
        module, _, half = name.rpartition(".")
        tensors[f"base_model.model.model.{module}.{half}.weight"] = t.to(torch.bfloat16).contiguous()
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    (tmp / "adapter_model.safetensors").chmod(0o644)  # package data: readable by every user
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": weights.rank, "lora_alpha": weights.rank,
        "target_modules": sorted(weights.targets), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "revision": None,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, out_dir)
    return (out_dir / "adapter_model.safetensors").stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("LORASERVE_SMOLLM2", str(DEFAULT_GGUF)),
                    help="the SmolLM2-135M-Instruct GGUF (default: $LORASERVE_SMOLLM2 or %(default)s)")
    ap.add_argument("--only", action="append", choices=[t.name for t in TASKS],
                    help="train only this task (repeatable)")
    ap.add_argument("--out", default=str(OUT), help="where the PEFT directories go (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--no-export", action="store_true", help="train and evaluate only")
    args = ap.parse_args()

    import mint
    import torch

    from loraserve.model.gguf import resolve_base
    from loraserve.tokenizer import Tokenizer

    torch.manual_seed(SEED)
    start = time.monotonic()
    base = resolve_base(args.model)
    tok = Tokenizer.from_dir(base)
    tasks = [t for t in TASKS if not args.only or t.name in args.only]
    work = Path(tempfile.mkdtemp(prefix="loraserve-demo-train-"))
    results: dict[str, dict] = {}
    try:
        with Server(base, work) as url:
            print(f"server up at {url} ({time.monotonic() - start:.0f} s)", flush=True)
            service = mint.ServiceClient(base_url=url, api_key="tml-local")
            base_sampler = service.create_sampling_client(base_model=SERVED)
            for task in tasks:
                print(f"== demo/{task.name}: {len(task.examples)} examples, {task.epochs} epochs, "
                      f"batch {args.batch}, lr {task.lr}, rank {RANK} (q/k/v/o)", flush=True)
                r = train(service, tok, task, args.batch)
                r["base"] = greedy(tok, base_sampler, task.held_out)
                r["adapter"] = greedy(tok, r["sampler"], task.held_out)
                results[task.name] = r
                losses = r["losses"]
                print(f"  loss/token: first {losses[0]:.3f}, min {min(losses):.3f}, last {losses[-1]:.3f} "
                      f"({r['steps']} steps, {r['seconds']:.0f} s)")
                for prompt, b, a in zip(task.held_out, r["base"], r["adapter"]):
                    print(f"  prompt:  {prompt}\n    base:    {b!r}\n    adapter: {a!r}")
                print(flush=True)
        if not args.no_export:
            for name, r in results.items():
                size = export_peft(work / "catalog", r["trainer"].model_id, Path(args.out) / name)
                print(f"exported demo/{name} -> {Path(args.out) / name} ({size / 1e6:.2f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nsummary (loss per answer token; first -> last):")
    for name, r in results.items():
        losses = r["losses"]
        print(f"  demo/{name}: {r['examples']} examples, {r['steps']} steps, {r['seconds']:.0f} s, "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"total {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
