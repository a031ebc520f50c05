"""The benchmark's model, tokenizer, adapters and prompts, written offline, then converted to GGUF.

Run it with the converter venv that `build.sh` makes (sentencepiece, transformers, peft, gguf;
the project's .venv stays as it is):

    .loraserve/llamacpp/venv/bin/python bench/llamacpp/make_model.py --out .loraserve/llamacpp/h512

Writes, under --out (every step is skipped when its output is there):
  hf/               Qwen3 checkpoint (float32 safetensors, random weights) with a SentencePiece
                    tokenizer: tokenizer.model (llama.cpp's converter reads it) and the same
                    tokenizer as tokenizer.json (what loraserve reads); both tokenize every
                    training line identically (checked here)
  peft/aNN/         --adapters PEFT LoRA adapters, rank --rank, on all seven projections
  gguf/base-f32.gguf, gguf/aNN-f32.gguf   the same weights for llama.cpp (f32, no quantization);
                    --outtypes f32,bf16 also writes gguf/base-bf16.gguf, gguf/aNN-bf16.gguf
  prompts.json      --prompts prompt texts (2-3 generated sentences: 30-105 tokens)

With --from-gguf FILE (a real model, e.g. SmolLM2-135M-Instruct's Q4_1 file from `make models`)
hf/ is that file as loraserve reads it (`loraserve.model.gguf.resolve_base`: dequantized to float32,
its own tokenizer and chat template, written by the project's .venv), and gguf/base-f32.gguf is
the file with every tensor dequantized to F32 by the `gguf` package (`gguf_to_float`; metadata and
tokenizer as in the file): both servers then run the same float32 weights
(run.py --llama-base FILE serves the original file on llama.cpp's side instead). --outtypes
f32,bf16 also writes gguf/base-bf16.gguf that way (2-D tensors rounded to BF16, norms F32: the
weights loraserve --dtype bfloat16 casts hf/ to), not with llama.cpp's converter, which refuses
hf/'s tokenizer; the adapters go through convert_lora_to_gguf.py as for a random base.
Make SmolLM2's f32 and bf16 files (8 adapters):

    .loraserve/llamacpp/venv/bin/python bench/llamacpp/make_model.py --out .loraserve/llamacpp/smollm2 \
        --from-gguf .venv/models/SmolLM2-135M-Instruct.Q4_1.gguf --adapters 8 --outtypes f32,bf16

Why this tokenizer: llama.cpp's converter recognises a byte-level BPE tokenizer only by a hash of
its pre-tokenizer output on a fixed text, so a home-made BPE vocabulary is refused. A SentencePiece
model is converted as such (Qwen2/Qwen3's `set_vocab` tries `tokenizer.model` first). Its vocab is
trained here on generated pseudo-words, so nothing comes from a model hub.
`add_bos_token` is false so that a text prompt tokenizes the same in both servers (loraserve's
completions endpoint adds no special tokens).

Weights follow loraserve's demo base (`loraserve/model/tiny.py`): matrices N(0, 1/fan_in), norms 1,
embeddings N(0, 1), lm_head N(0, 4/H) (rows of <unk> <s> </s> zero), so the random base decodes with confident logits and greedy
outputs are robust to float32 rounding differences between implementations. LoRA A is
N(0, 1/fan_in) and B is N(0, sigma^2) with `alpha = 2 r`, so each adapter changes the output.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 4096


def pseudo_text(seed: int, lines: int) -> list[str]:
    """Sentences of Zipf-distributed pseudo-words, numbers and punctuation."""
    rng = random.Random(seed)
    cons, vow = "bcdfghjklmnprstvwz", "aeiou"
    syl = [c + v for c in cons for v in vow] + [c + v + "n" for c in cons[:8] for v in vow]
    words = sorted({"".join(rng.choice(syl) for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 3, 4])))
                    for _ in range(8000)})
    rng.shuffle(words)
    weights = [1 / (i + 1) for i in range(len(words))]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        ws = rng.choices(words, weights, k=n)
        if rng.random() < 0.2:
            ws.insert(rng.randrange(n), str(rng.randint(0, 9999)))
        s = " ".join(ws)
        out.append(s[0].upper() + s[1:] + rng.choice([".", ".", "!", "?", ",", ";"]))
    return out


def write_tokenizer(hf: Path, work: Path) -> None:
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    corpus = pseudo_text(0, 30000)
    (work / "corpus.txt").write_text("\n".join(corpus))
    spm.SentencePieceTrainer.train(
        input=str(work / "corpus.txt"), model_prefix=str(work / "tok"), vocab_size=VOCAB,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        num_threads=2, minloglevel=2)
    # legacy=True + add_prefix_space=True: a Prepend("▁") normalizer, exactly SentencePiece's
    # dummy prefix (also before a leading space)
    fast = LlamaTokenizerFast(vocab_file=str(work / "tok.model"), from_slow=True, legacy=True,
                              add_prefix_space=True, add_bos_token=False, add_eos_token=False)
    fast.save_pretrained(hf)
    sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    import tokenizers
    tj = tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json"))
    bad = [t for t in corpus[:3000] if sp.encode(t) != tj.encode(t, add_special_tokens=False).ids]
    if bad:
        raise SystemExit(f"tokenizer.json disagrees with tokenizer.model on {len(bad)} lines, "
                         f"e.g. {bad[0]!r}")


def write_base(hf: Path, hidden: int, layers: int, head_dim: int, seed: int,
               heads: int | None = None) -> None:
    """heads: query heads (default hidden // head_dim); kv heads are half of them, the MLP 3x
    hidden (Qwen3-0.6B: --hidden 1024 --layers 28 --head-dim 128 --heads 16)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    heads = heads or max(hidden // head_dim, 2)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(heads // 2, 1), head_dim=head_dim,
                      max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    model = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = (1.0 if name == "model.embed_tokens.weight" else
                   2.0 / hidden ** 0.5 if name == "lm_head.weight" else 1.0 / p.shape[-1] ** 0.5)
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        # <unk> <s> </s> get logit 0 against ~N(0, 4) for the rest, so greedy decoding never
        # picks them: `ignore_eos` means "mask EOS" in llama.cpp but "keep going after EOS" in
        # loraserve, and this keeps that difference out of the comparison
        model.lm_head.weight[:3] = 0.0
    model.eval().save_pretrained(hf, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False).save_pretrained(hf)


def from_gguf(file: Path, hf: Path) -> None:
    """hf/ = the GGUF file as loraserve serves it (converted by the project's own venv)."""
    import shutil

    venv_python = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    converted = subprocess.run(
        [str(venv_python), "-P", "-c", "import sys; from loraserve.model.gguf import resolve_base; "
         "print(resolve_base(sys.argv[1]))", str(file)], check=True, capture_output=True, text=True)
    shutil.copytree(Path(converted.stdout.strip().splitlines()[-1]), hf,
                    ignore=shutil.ignore_patterns("loraserve-gguf.json"))


def gguf_to_float(src: Path, dst: Path, outtype: str = "f32") -> None:
    """dst = src with every tensor dequantized to F32 by the `gguf` package (llama.cpp's own
    reader and reference dequantizers), metadata and tokenizer copied as they are: what llama.cpp
    serves as "the f32 GGUF" of a quantized file. The file's own tokenizer metadata is kept, so
    llama.cpp tokenizes as it does with the original (converting the hf/ directory back would
    need llama.cpp's converter to know the tokenizer class loraserve wrote: the project's
    transformers writes `TokenizersBackend`, which the converter venv's transformers refuses).

    outtype bf16 or f16: then the F32 values are rounded as `convert_hf_to_gguf.py --outtype
    bf16/f16` rounds the checkpoint it reads (gguf.quants.quantize: bf16 to nearest even, as
    torch's `.to(bfloat16)`): tensors of 2 or more dimensions become BF16/F16, 1-D tensors and
    `*_norm.weight` stay F32, and general.file_type says MOSTLY_BF16/MOSTLY_F16."""
    import gguf
    import numpy as np

    qtype, ftype = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
                    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
                    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16)}[outtype]
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(ftype)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        data = np.ascontiguousarray(data)
        kind = gguf.GGMLQuantizationType.F32
        if data.ndim >= 2 and not t.name.endswith("_norm.weight"):
            kind = qtype
            data = gguf.quants.quantize(data, kind)   # F32: returned as it is
        tensors.append((t.name, data))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data in tensors:
        writer.write_tensor_data(data)
    writer.close()


def write_adapters(hf: Path, peft_root: Path, n: int, rank: int, sigma: float) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i in range(n):
        out = peft_root / f"a{i:02d}"
        if (out / "adapter_model.safetensors").is_file():
            continue
        base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                lora_dropout=0.0, init_lora_weights=False))
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * sigma)
        model.save_pretrained(out)


def llamacpp_src(cache: Path) -> Path:
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"no llama.cpp sources under {cache}; run bench/llamacpp/build.sh first")
    return found[-1]


def convert(out: Path, n: int, cache: Path, outtype: str = "f32", from_gguf: Path | None = None) -> None:
    """The base and n adapters as gguf/base-{outtype}.gguf and gguf/aNN-{outtype}.gguf. f32 keeps
    the checkpoint's weights exactly; bf16 and f16 round them (bf16 as torch's `.to(bfloat16)`
    does: round to nearest even), and the converter keeps 1-D tensors (norms) in f32. With
    from_gguf the base is that file's tensors in outtype (`gguf_to_float`)."""
    src = llamacpp_src(cache)
    gg = out / "gguf"
    gg.mkdir(exist_ok=True)
    base = gg / f"base-{outtype}.gguf"
    if not base.is_file() and from_gguf is not None:
        gguf_to_float(from_gguf, Path(str(base) + ".tmp"), outtype)
        Path(str(base) + ".tmp").rename(base)
    if not base.is_file():
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(out / "hf"),
                        "--outtype", outtype, "--outfile", str(base) + ".tmp"], check=True)
        Path(str(base) + ".tmp").rename(base)
    todo = [i for i in range(n) if not (gg / f"a{i:02d}-{outtype}.gguf").is_file()]
    # two converters at a time (each is mostly python start-up)
    procs: list[tuple[int, subprocess.Popen]] = []
    for i in todo + [None, None]:
        if i is not None:
            procs.append((i, subprocess.Popen(
                [sys.executable, str(src / "convert_lora_to_gguf.py"), str(out / "peft" / f"a{i:02d}"),
                 "--base", str(out / "hf"), "--outtype", outtype,
                 "--outfile", str(gg / f"a{i:02d}-{outtype}.gguf.tmp")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        while len(procs) >= (2 if i is not None else 1):
            j, p = procs.pop(0)
            _, err = p.communicate()
            if p.returncode:
                raise SystemExit(f"convert_lora_to_gguf failed on a{j:02d}:\n{err.decode()[-3000:]}")
            (gg / f"a{j:02d}-{outtype}.gguf.tmp").rename(gg / f"a{j:02d}-{outtype}.gguf")


def write_prompts(out: Path, n: int) -> None:
    rng = random.Random(7)
    lines = pseudo_text(123, 4 * n)
    prompts = [" ".join(lines[4 * i: 4 * i + rng.randint(2, 3)]) for i in range(n)]
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=None, help="query heads (default hidden / head dim)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--sigma", type=float, default=0.04, help="std of LoRA B entries")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outtypes", default="f32",
                    help="GGUF weight types to write, comma-separated: f32, bf16, f16 (the "
                         "checkpoint stays float32; run.py --dtype picks one)")
    ap.add_argument("--from-gguf", type=Path, default=None,
                    help="the base is this GGUF file (a real model) instead of a random Qwen3")
    ap.add_argument("--cache", type=Path, default=None,
                    help="build.sh's cache dir (default: the parent of --out)")
    args = ap.parse_args()
    out: Path = args.out.resolve()
    hf = out / "hf"
    (out / "work").mkdir(parents=True, exist_ok=True)
    if args.from_gguf is not None:
        if not (hf / "model.safetensors").is_file():
            from_gguf(args.from_gguf.resolve(), hf)
    else:
        if not (hf / "tokenizer.json").is_file():
            write_tokenizer(hf, out / "work")
        if not (hf / "model.safetensors").is_file():
            write_base(hf, args.hidden, args.layers, args.head_dim, args.seed, args.heads)
    write_adapters(hf, out / "peft", args.adapters, args.rank, args.sigma)
    for outtype in args.outtypes.split(","):
        convert(out, args.adapters, (args.cache or out.parent).resolve(), outtype.strip(),
                args.from_gguf and args.from_gguf.resolve())
    if not (out / "prompts.json").is_file():
        write_prompts(out, args.prompts)
    print(f"model, {args.adapters} adapters and prompts under {out}")


if __name__ == "__main__":
    main()
