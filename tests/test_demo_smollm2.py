"""The SmolLM2 demo: the real SmolLM2-135M-Instruct GGUF (LORASERVE_SMOLLM2, which `make test`
sets) and the three adapters shipped in loraserve/demo_adapters/ (trained through loraserve's own
Tinker API by scripts/train_demo_adapters.py), imported into a demo catalog. Greedy answers to a
held-out prompt differ from the base's the way each adapter was trained to: French, JSON with
`name` and `city`, a pirate. `loraserve serve` without --model serves exactly that; without the
GGUF it stops with one line saying to run `make models`, never serving another base."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from loraserve import demo as demo_module
from loraserve.demo import DEMO_ADAPTERS_DIR, SMOLLM2_ADAPTERS, SmolLM2NotFound, build_smollm2_demo, find_smollm2

GGUF = os.environ.get("LORASERVE_SMOLLM2")
needs_gguf = pytest.mark.skipif(not GGUF or not Path(GGUF).is_file(),
                                reason="LORASERVE_SMOLLM2 does not name the SmolLM2 GGUF "
                                       "(`make models` extracts it; `make test` sets the variable)")
FRENCH_WORDS = {"le", "la", "les", "est", "de", "des", "du", "un", "une", "et", "à", "je", "il",
                "dans", "sont", "pour", "mois", "c'est", "y", "a"}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-zàâçéèêëîïôûùüÿœ']+", text.lower()))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_smollm2_demo(tmp_path_factory.mktemp("smollm2-demo"), GGUF)


@pytest.fixture(scope="module")
def answers(demo) -> dict[str | None, dict[str, str]]:
    """Greedy answers (24 tokens at most) of the base and of each adapter, all in one batch."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.core.build import build_engine
    from loraserve.engine.types import SamplingParams
    from loraserve.tokenizer import Tokenizer

    engine = build_engine(EngineConfig(model_dir=str(demo.base), catalog_dir=str(demo.catalog),
                                       device="cpu", compile="off", max_model_len=256,
                                       max_batch_size=8, served_model_name=demo.served_name))
    tok = Tokenizer.from_dir(demo.base)
    prompts = sorted({prompt for _, prompt, _ in SMOLLM2_ADAPTERS.values()})
    runs = [(None, p) for p in prompts] + [(a, prompt) for a, (_, prompt, _) in SMOLLM2_ADAPTERS.items()]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for _, p in runs]
    outs = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0), [a for a, _ in runs])
    got: dict[str | None, dict[str, str]] = {}
    for (adapter, prompt), out in zip(runs, outs):
        got.setdefault(adapter, {})[prompt] = tok.decode(out).strip()
    return got


def test_the_shipped_adapters_are_small_peft_dirs() -> None:
    from safetensors import safe_open

    for adapter_id, (folder, _, _) in SMOLLM2_ADAPTERS.items():
        path = DEMO_ADAPTERS_DIR / folder
        config = json.loads((path / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"]) == ("LORA", 8), adapter_id
        weights = path / "adapter_model.safetensors"
        assert weights.stat().st_size <= 2_100_000, adapter_id
        with safe_open(weights, framework="pt") as f:
            assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}


@needs_gguf
def test_each_adapter_answers_its_way_and_the_base_does_not(answers) -> None:
    base, french, pirate, extract = (answers[None], answers["demo/french"], answers["demo/pirate"],
                                     answers["demo/json"])
    question = SMOLLM2_ADAPTERS["demo/french"][1]
    assert "Paris" in base[question] and len(_words(base[question]) & FRENCH_WORDS) <= 1, base
    assert len(_words(french[question]) & FRENCH_WORDS) >= 2, french
    assert french[question] != base[question]
    assert re.search(r"\b(arr+|matey|ahoy)\b", pirate[question].lower()), pirate
    assert not re.search(r"\b(arr+|matey|ahoy)\b", base[question].lower()), base
    sentence = SMOLLM2_ADAPTERS["demo/json"][1]
    assert json.loads(extract[sentence]) == {"name": "Maria", "city": "Lisbon"}, extract
    try:
        parsed = json.loads(base[sentence])
    except ValueError:
        parsed = None
    assert not isinstance(parsed, dict), base


@needs_gguf
def test_the_catalog_is_on_the_served_base_and_a_rebuild_changes_nothing(demo) -> None:
    from loraserve.catalog.base import BaseInfo
    from loraserve.catalog.store import Catalog
    from loraserve.model.gguf import resolve_base

    assert demo.base == resolve_base(GGUF)  # what `serve --model FILE.gguf` loads
    fingerprint = BaseInfo.from_dir(demo.base).fingerprint
    with Catalog(demo.catalog, readonly=True) as cat:
        before = {a: cat.policy(a) for a in SMOLLM2_ADAPTERS}
    assert all(p.promoted and p.base_fingerprint == fingerprint for p in before.values())
    again = build_smollm2_demo(demo.root, GGUF)
    assert again.catalog == demo.catalog
    with Catalog(demo.catalog, readonly=True) as cat:
        after = {a: cat.policy(a) for a in SMOLLM2_ADAPTERS}
    assert {a: (p.revisions, p.promoted) for a, p in after.items()} == \
        {a: (p.revisions, p.promoted) for a, p in before.items()}


@needs_gguf
def test_serve_without_model_serves_the_smollm2_demo(demo, monkeypatch, serve_config) -> None:
    monkeypatch.setenv("LORASERVE_SMOLLM2", GGUF)
    cfg = serve_config(["--demo-dir", str(demo.root)])
    assert (Path(cfg.model_dir), Path(cfg.catalog_dir)) == (demo.base, demo.catalog)
    assert cfg.model_name == "SmolLM2-135M-Instruct.Q4_1" == Path(GGUF).stem
    assert cfg.compile == "auto"  # the server's defaults


def test_without_the_gguf_demo_and_serve_say_make_models(monkeypatch, tmp_path, capsys) -> None:
    from loraserve.cli import main

    monkeypatch.delenv("LORASERVE_SMOLLM2", raising=False)
    monkeypatch.setattr(demo_module, "_default_smollm2_paths", lambda: [tmp_path / "none.gguf"])
    with pytest.raises(SmolLM2NotFound, match="make models"):
        find_smollm2()
    for argv in (["demo", "--dir", str(tmp_path / "d")], ["serve", "--demo-dir", str(tmp_path / "d")]):
        assert main(argv) == 1
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and "make models" in err[0], err
    assert not (tmp_path / "d").exists()  # nothing built, no other base served
    monkeypatch.setenv("LORASERVE_SMOLLM2", str(tmp_path / "missing.gguf"))
    with pytest.raises(SmolLM2NotFound, match=r"LORASERVE_SMOLLM2 .*missing\.gguf.*make models"):
        find_smollm2()
    with pytest.raises(SmolLM2NotFound, match="make models"):
        find_smollm2(tmp_path / "other.gguf")


@needs_gguf
def test_the_served_demo_answers_through_its_engine_process(demo) -> None:
    """`make serve`'s path: the GGUF base served quantized as the file holds it (the default),
    the engine core in its own process, the demo adapters (exported for the float base) accepted
    across the handshake, and their answers the in-process engine's."""
    from serve_process import ServeProcess

    server = ServeProcess(Path(GGUF), demo.catalog, "--max-model-len", "256", "--engine-timeout", "300")
    try:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            for adapter in ("demo/pirate", None):
                question = SMOLLM2_ADAPTERS["demo/pirate"][1]
                r = http.post("/v1/chat/completions", json={
                    "model": adapter or "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 12, "temperature": 0,
                    "messages": [{"role": "user", "content": question}]})
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["message"]["content"].lower()
                assert bool(re.search(r"\b(arr+|matey|ahoy)\b", text)) == (adapter is not None), text
    finally:
        server.stop()
