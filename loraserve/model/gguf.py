"""GGUF base files: `serve --model path/model.gguf` turns the file into a Hugging Face directory
once, in a cache, and everything downstream (engine, catalog fingerprint, tokenizer, exporter)
reads that directory as it reads any other base.

`resolve_base(path)` returns a directory unchanged. A GGUF file (recognised by its magic bytes) is
converted into `${LORASERVE_CACHE:-~/.cache/loraserve}/gguf/<key>`, key = xxh3-128 of the file's
bytes, `CONVERTER_VERSION` and the weights' dtype: `config.json` from the metadata,
`model.safetensors` (float32, transformers' tensor names) dequantized with llama.cpp's own reader
and dequantizers (the `gguf` package), and `tokenizer.json` / `tokenizer_config.json` /
`chat_template.jinja` from transformers' GGUF tokenizer conversion. The folder is built under a
temporary sibling name and renamed into place, and counts as complete only once it holds
`MARKER`, so a crash or a concurrent start never leaves half a folder in use; a second call with
the same file reuses it.

What the conversion undoes: llama.cpp's converter permutes the rows of Llama-architecture Q and K
projections (weights and biases) for its rotary layout (GGUF architecture `llama`, which Mistral
files use too); Qwen2/Qwen3 are stored unpermuted. Llama 3.1's RoPE scaling is stored as a
`rope_freqs.weight` tensor of per-frequency divisors, read back into the `llama3` rope parameters.

Anything that is not a directory or a GGUF file loraserve can serve raises `GGUFError` with one
line naming the file and what is wrong.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from loraserve.catalog.checkpoint import SINGLE_FILE
from loraserve.model.arch import ModelConfigError, RopeScaling
from loraserve.model.config import ModelConfig

__all__ = ["CONVERTER_VERSION", "GGUFError", "MARKER", "SUPPORTED_ARCHS", "SUPPORTED_TENSOR_TYPES",
           "cache_dir", "is_gguf_file", "resolve_base"]

CONVERTER_VERSION = "2"   # bump when the folder written for the same file changes
WEIGHT_DTYPE = "float32"  # the dtype the weights are written in (part of the cache key)
MARKER = "loraserve-gguf.json"  # written last: a folder without it is incomplete
GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` -> config.json model_type
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
_PERMUTED_ARCHS = ("llama",)  # llama.cpp permutes Q/K rows of these
_CHUNK_ELEMENTS = 1 << 24     # dequantize at most this many values at a time
_HASH_CHUNK = 1 << 24
log = logging.getLogger(__name__)

# GGUF tensor name (after `blk.{i}.`) -> HF name (after `model.layers.{i}.`)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# control tokens llama.cpp ends generation on by their text (llama-vocab.cpp's EOG list)
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                        "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>"})
_CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of control tokens
# Meta's Llama 3.1 / 3.2 values (low_freq_factor, high_freq_factor, original context)
_LLAMA3_CANONICAL = (1.0, 4.0, 8192)


class GGUFError(ValueError):
    """A GGUF file loraserve cannot serve: not GGUF, truncated, or of an unsupported kind."""


class _Truncated(Exception):
    """Raised by the reader when the file ends before what it describes."""


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a regular file that starts with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def cache_dir() -> Path:
    """`${LORASERVE_CACHE:-~/.cache/loraserve}/gguf`: where converted GGUF files are kept."""
    root = os.environ.get("LORASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "loraserve")
    return Path(root) / "gguf"


def resolve_base(path: str | Path) -> Path:
    """The Hugging Face directory of base model `path`: a directory as it is, a GGUF file
    converted into (or found in) the cache. GGUFError for anything else."""
    path = Path(path)
    if path.is_dir():
        return path
    if not path.exists():
        raise GGUFError(f"{path}: no such file or directory (expected a model directory or a .gguf file)")
    if not path.is_file():
        raise GGUFError(f"{path}: not a model directory or a .gguf file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {head!r}, not {GGUF_MAGIC!r}) "
                        "and not a model directory")
    key = _cache_key(path)
    final = cache_dir() / key
    if _complete(final):
        return _repoint(final, path)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f".{key}.lock"):
        if _complete(final):  # another process finished it while we waited
            return _repoint(final, path)
        tmp = final.parent / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        log.info("converting %s into %s (once: later starts reuse it)", path, final)
        started = time.monotonic()
        try:
            _convert(path, tmp, key)
            if final.exists():  # incomplete leftover of something else: move aside, then drop
                stale = final.parent / f".{key}.stale-{uuid.uuid4().hex[:8]}"
                os.replace(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", path, time.monotonic() - started)
    return final


def _cache_key(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    h.update(f"\0loraserve-gguf\0{CONVERTER_VERSION}\0{WEIGHT_DTYPE}".encode())
    return h.hexdigest()


def _complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _repoint(folder: Path, path: Path) -> Path:
    """`folder` (a converted file's cache entry, found by the bytes' hash), its MARKER's source
    made `path` when it names another file: the same bytes, reached by another path (a copy, a
    move, another checkout's), whose blocks the quantized base is repacked from
    (quant_gguf.source_file), not a file that may since have gone."""
    marker_file = folder / MARKER
    marker = json.loads(marker_file.read_text())
    source = str(path.resolve())
    if marker.get("source") != source:
        marker["source"] = source
        tmp = folder / f".{MARKER}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, marker_file)  # atomic: a reader sees the old marker or the new one
    return folder


@contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """An exclusive advisory lock, so concurrent starts convert a file once."""
    with open(lock_file, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# -- reading ---------------------------------------------------------------------------------
def _open_reader(path: Path):
    """gguf.GGUFReader over `path`, with every read bounded by the file's end."""
    try:
        import gguf
    except ImportError as e:  # a runtime dependency; only a broken install lacks it
        raise GGUFError(f"{path}: reading GGUF files needs the `gguf` package ({e})") from None

    class BoundedReader(gguf.GGUFReader):
        # GGUFReader slices its memmap without checking the end: a truncated file would yield
        # short arrays (or a header loop over a garbage count that never ends). Refuse instead.
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if int(offset) < 0 or end > len(self.data):
                raise _Truncated(f"needs bytes up to {end}, the file has {len(self.data)}")
            return super()._get(offset, dtype, count, override_order)

    try:
        reader = BoundedReader(str(path))
    except _Truncated as e:
        raise GGUFError(f"{path}: truncated GGUF file ({e})") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as e:
        raise GGUFError(f"{path}: corrupt GGUF file ({_one_line(e)})") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({_one_line(e)})") from None
    if reader.byte_order != "I":
        raise GGUFError(f"{path}: a GGUF file of the other byte order (big-endian) is not supported")
    return reader


def _one_line(e: BaseException | str) -> str:
    text = str(e) if not isinstance(e, BaseException) else (str(e) or type(e).__name__)
    return " ".join(text.split())


class _Meta:
    """The metadata of a GGUF file: scalars and strings by key, arrays' lengths."""

    def __init__(self, path: Path, reader):
        import gguf
        self._path, self._fields, self._array = path, reader.fields, gguf.GGUFValueType.ARRAY

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self._path}: metadata {key} is unreadable ({_one_line(e)})") from None

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise GGUFError(f"{self._path}: metadata {key} is missing")
        return self.get(key)

    def array_length(self, key: str) -> int | None:
        field = self._fields.get(key)
        if field is None or not field.types or field.types[0] != self._array:
            return None
        return len(field.data)

    def number(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        value = self.require(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, (list, str)) or (kind is int and isinstance(value, float)):
            raise GGUFError(f"{self._path}: metadata {key} must be a single {kind.__name__}, got {value!r}")
        return kind(value)


# -- the plan: which HF tensor comes from which GGUF tensor -------------------------------------
@dataclass(slots=True)
class _Output:
    """One tensor of the written checkpoint."""

    name: str                # HF name
    shape: tuple[int, ...]   # torch order
    source: Any              # gguf ReaderTensor
    expert: int | None = None  # plane of a packed [E, ...] expert tensor
    permute_heads: int | None = None  # undo llama.cpp's rotary row permutation over this many heads


def _torch_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _check_types(path: Path, tensors: list) -> None:
    import gguf
    supported = {gguf.GGMLQuantizationType[name] for name in SUPPORTED_TENSOR_TYPES}
    for t in tensors:
        if t.tensor_type not in supported:
            raise GGUFError(f"{path}: unsupported tensor type {t.tensor_type.name} for tensor {t.name} "
                            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")


def _plan(path: Path, tensors: dict[str, Any], arch: str, config: ModelConfig) -> list[_Output]:
    """The checkpoint tensors, named as transformers names them, from the GGUF tensors."""
    permute = arch in _PERMUTED_ARCHS
    out: list[_Output] = []
    for name, t in tensors.items():
        shape = _torch_shape(t)
        if name == _ROPE_FREQS:
            continue  # read into the config
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL_TENSORS and suffix == "weight":
            out.append(_Output(f"{_GLOBAL_TENSORS[stem]}.weight", shape, t))
            continue
        m = _LAYER_NAME.fullmatch(name)
        if m is None or (m[2] not in _LAYER_TENSORS and m[2] not in _EXPERT_TENSORS):
            raise GGUFError(f"{path}: tensor {name} has no place in a {arch} model")
        layer, kind, suffix = int(m[1]), m[2], m[3]
        prefix = f"model.layers.{layer}"
        if kind in _EXPERT_TENSORS:
            if suffix != "weight" or len(shape) != 3 or shape[0] != config.num_experts:
                raise GGUFError(f"{path}: tensor {name} of shape {list(shape)} is no packed weight "
                                f"of {config.num_experts} experts")
            proj = _EXPERT_TENSORS[kind]
            out += [_Output(f"{prefix}.mlp.experts.{e}.{proj}.weight", shape[1:], t, expert=e)
                    for e in range(shape[0])]
            continue
        heads = None
        if permute and kind in ("attn_q", "attn_k"):
            heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
        out.append(_Output(f"{prefix}.{_LAYER_TENSORS[kind]}.{suffix}", shape, t, permute_heads=heads))
    return out


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor `load_model` reads for `config`."""
    from loraserve.model.loader import _checkpoint_names
    from loraserve.model.transformer import CausalLM

    model = CausalLM(config, device="meta")
    return {n: tuple(s) for name, p in model.named_parameters() for n, s in _checkpoint_names(name, p.shape)}


def _check_plan(path: Path, plan: list[_Output], config: ModelConfig) -> None:
    expected = _expected_shapes(config)
    have = {o.name: o for o in plan}
    for name, shape in expected.items():
        if name not in have:
            raise GGUFError(f"{path}: tensor for {name} (shape {list(shape)}) is missing")
        if have[name].shape != shape:
            raise GGUFError(f"{path}: tensor {have[name].source.name} has shape {list(have[name].shape)}, "
                            f"expected {list(shape)} for {name} from the metadata")
    extra = [o.source.name for o in plan if o.name not in expected]
    if extra:
        raise GGUFError(f"{path}: tensor {extra[0]} has no place in this {config.arch} model "
                        f"(its metadata describes no such part)")


# -- config ----------------------------------------------------------------------------------
def _serving_dtype(tensors: dict[str, Any]) -> str:
    """The dtype `--dtype auto` serves on CUDA (the CPU serves float32): float32 for a file whose
    matrices are all F32, float16 for all F16, else bfloat16 (BF16 and quantized files). The
    weights themselves are written in float32 (WEIGHT_DTYPE) whatever this says."""
    types = {t.tensor_type.name for t in tensors.values() if len(t.shape) >= 2}
    return "float32" if types <= {"F32"} else "float16" if types == {"F16"} else "bfloat16"


def _config(path: Path, meta: _Meta, gguf_arch: str, tensors: dict[str, Any]) -> tuple[ModelConfig, dict]:
    """The ModelConfig the metadata describes, and config.json's extra token ids."""
    arch = SUPPORTED_ARCHS[gguf_arch]
    key = lambda name: f"{gguf_arch}.{name}"  # noqa: E731
    hidden = meta.number(key("embedding_length"), int, required=True)
    layers = meta.number(key("block_count"), int, required=True)
    if layers > len(tensors):  # a garbage count must not build a model of that many layers
        raise GGUFError(f"{path}: {key('block_count')} is {layers} but the file has {len(tensors)} tensors")
    heads = meta.number(key("attention.head_count"), int, required=True)
    kv_heads = meta.number(key("attention.head_count_kv"), int, default=heads)
    head_dim = meta.number(key("attention.key_length"), int)
    rope_dims = meta.number(key("rope.dimension_count"), int)
    if head_dim is None:
        head_dim = rope_dims if rope_dims is not None else (hidden // heads if heads else 0)
    value_dim = meta.number(key("attention.value_length"), int)
    if value_dim is not None and value_dim != head_dim:
        raise GGUFError(f"{path}: value head size {value_dim} differs from key head size {head_dim}, "
                        "which loraserve does not support")
    if rope_dims is not None and rope_dims != head_dim:
        raise GGUFError(f"{path}: partial rotary embedding ({rope_dims} of {head_dim} head dims) "
                        "is not supported")
    vocab = meta.array_length("tokenizer.ggml.tokens")
    if vocab is None:
        raise GGUFError(f"{path}: metadata tokenizer.ggml.tokens is missing "
                        "(a GGUF file without its tokenizer)")
    stated_vocab = meta.number(key("vocab_size"), int)
    if stated_vocab is not None and stated_vocab != vocab:
        raise GGUFError(f"{path}: {key('vocab_size')} is {stated_vocab} but the tokenizer has {vocab} tokens")
    theta = meta.number(key("rope.freq_base"), float, default=10000.0)
    context = meta.number(key("context_length"), int, required=True)
    fields: dict[str, Any] = dict(
        arch=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), float, required=True),
        rope_theta=theta, max_position_embeddings=context,
        rope_scaling=_rope_scaling(path, meta, gguf_arch, tensors, head_dim, theta),
        tie_word_embeddings="output.weight" not in tensors, torch_dtype=_serving_dtype(tensors),
        eos_token_ids=_eos_ids(meta, vocab),
    )
    dense_ff = meta.number(key("feed_forward_length"), int)
    if arch == "llama":
        fields["attention_bias"] = any(f"blk.{l}.attn_{p}.bias" in tensors
                                       for l in range(layers) for p in ("q", "k", "v", "output"))
        fields["mlp_bias"] = any(f"blk.{l}.ffn_{p}.bias" in tensors
                                 for l in range(layers) for p in ("gate", "up", "down"))
    if arch == "qwen3_moe":
        expert_ff = meta.number(key("expert_feed_forward_length"), int, required=True)
        fields.update(
            num_experts=meta.number(key("expert_count"), int, required=True),
            num_experts_per_tok=meta.number(key("expert_used_count"), int, required=True),
            moe_intermediate_size=expert_ff,
            # llama.cpp's qwen3moe always renormalises the top-k weights
            norm_topk_prob=bool(meta.get(key("expert_weights_norm"), True)),
            mlp_only_layers=[l for l in range(layers) if f"blk.{l}.ffn_gate_exps.weight" not in tensors],
        )
        fields["intermediate_size"] = dense_ff or expert_ff
    else:
        if dense_ff is None:
            raise GGUFError(f"{path}: metadata {key('feed_forward_length')} is missing")
        fields["intermediate_size"] = dense_ff
    try:
        config = ModelConfig(**fields)
    except ModelConfigError as e:
        raise GGUFError(f"{path}: its metadata is no model loraserve can serve: {_one_line(e)}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise GGUFError(f"{path}: its metadata is malformed: {_one_line(e)}") from None
    extra = {}
    for name in ("bos", "padding"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(value, int) and 0 <= value < vocab:
            extra["bos_token_id" if name == "bos" else "pad_token_id"] = value
    return config, extra


def _eos_ids(meta: _Meta, vocab: int) -> list[int]:
    """llama.cpp's end-of-generation ids: EOS, EOT and EOM where the file names them, then the
    control tokens llama.cpp also stops on by their text (a chat model's file often names only
    one of `<|endoftext|>` and `<|im_end|>` as EOS)."""
    ids = []
    for name in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(value, int) and 0 <= value < vocab and value not in ids:
            ids.append(value)
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if isinstance(tokens, list) and isinstance(types, list) and len(types) == len(tokens):
        ids += [i for i, (text, kind) in enumerate(zip(tokens, types))
                if kind == _CONTROL_TOKEN and text in _EOG_TEXTS and i not in ids]
    return ids


def _rope_scaling(path: Path, meta: _Meta, gguf_arch: str, tensors: dict[str, Any], head_dim: int,
                  theta: float) -> RopeScaling | None:
    kind = meta.get(f"{gguf_arch}.rope.scaling.type")
    factor = meta.get(f"{gguf_arch}.rope.scaling.factor")
    if kind not in (None, "none") and not (isinstance(factor, (int, float)) and factor == 1.0):
        raise GGUFError(f"{path}: rope scaling {kind!r} (factor {factor}) is not supported "
                        "(supported: none, Llama 3's rope_freqs)")
    if _ROPE_FREQS not in tensors:
        return None
    import gguf
    t = tensors[_ROPE_FREQS]
    if t.tensor_type != gguf.GGMLQuantizationType.F32 or _torch_shape(t) != (head_dim // 2,):
        raise GGUFError(f"{path}: tensor {_ROPE_FREQS} must be F32 of shape [{head_dim // 2}]")
    return _llama3_scaling(path, np.array(t.data, dtype=np.float64), head_dim, theta)


def _llama3_factors(freqs: np.ndarray, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3's scaling (its converter's formula)."""
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))


def _llama3_scaling(path: Path, divisors: np.ndarray, head_dim: int, theta: float) -> RopeScaling | None:
    """The `llama3` rope parameters whose per-frequency divisors are `divisors`.

    The divisors depend on the band edges' wavelengths alone, so low_freq_factor 1 is taken
    unless Meta's published values fit; the edges come from the smoothly scaled frequencies."""
    if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise GGUFError(f"{path}: tensor {_ROPE_FREQS} holds non-positive or non-finite values")
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(divisors.max())
    candidates = [_LLAMA3_CANONICAL]
    smooth_idx = np.where((divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6)))[0]
    if len(smooth_idx) >= 2:  # s = a * freq + b with low = 1: high = 1 - 1/b, original = -2 pi a / b
        s = (1 / divisors[smooth_idx] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(freqs[smooth_idx], s, 1)
        if b < 0:  # config.json holds the original context as an integer
            candidates.append((1.0, 1 - 1 / b, round(-2 * math.pi * a / b)))
    for low, high, original in candidates:
        if high > low and original > 0 and np.allclose(
                _llama3_factors(freqs, factor, low, high, original), divisors, rtol=1e-5, atol=0):
            try:
                return RopeScaling("llama3", factor, float(low), float(high), int(original))
            except ModelConfigError:
                break
    raise GGUFError(f"{path}: tensor {_ROPE_FREQS} is not Llama 3's rope scaling, which is the only "
                    "one supported")


# -- writing ---------------------------------------------------------------------------------
def _convert(path: Path, out: Path, key: str) -> None:
    """Write the Hugging Face directory of GGUF file `path` to `out` (MARKER last)."""
    reader = _open_reader(path)
    meta = _Meta(path, reader)
    gguf_arch = meta.get("general.architecture")
    if not isinstance(gguf_arch, str) or gguf_arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: unsupported architecture {gguf_arch!r} "
                        f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    splits = meta.get("split.count")
    if isinstance(splits, int) and splits > 1:
        raise GGUFError(f"{path}: one part of a GGUF file split in {splits}; merge the parts into one "
                        "file first (llama.cpp's `llama-gguf-split --merge`)")
    _check_types(path, reader.tensors)
    tensors = {t.name: t for t in reader.tensors}
    config, token_ids = _config(path, meta, gguf_arch, tensors)
    plan = _plan(path, tensors, gguf_arch, config)
    _check_plan(path, plan, config)
    out.mkdir(parents=True)
    _write_tokenizer(path, out, config.vocab_size)
    _write_weights(path, out / SINGLE_FILE, sorted(plan, key=lambda o: o.name))
    hf = config.to_hf_dict()
    hf.update(token_ids)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    marker = {"source": str(path.resolve()), "source_bytes": path.stat().st_size, "key": key,
              "converter_version": CONVERTER_VERSION, "dtype": WEIGHT_DTYPE,
              "architecture": gguf_arch, "name": meta.get("general.name")}
    (out / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(path: Path, out: Path, vocab_size: int) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja by transformers' GGUF
    tokenizer conversion (the file alone, linked into an empty folder, so nothing beside it
    is read)."""
    try:
        import transformers
    except ImportError as e:
        raise GGUFError(f"{path}: building its tokenizer needs transformers ({e})") from None
    with tempfile.TemporaryDirectory(prefix="loraserve-gguf-tok-") as tmp:
        link = Path(tmp) / "model.gguf"
        link.symlink_to(path.resolve())
        saved = Path(tmp) / "saved"
        try:
            tok = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file=link.name, local_files_only=True)
            tok.save_pretrained(saved)
        except Exception as e:  # transformers' conversion fails in many ways on odd files
            raise GGUFError(f"{path}: cannot build its tokenizer "
                            f"({type(e).__name__}: {_one_line(e)})") from None
        if not (saved / "tokenizer.json").is_file():
            raise GGUFError(f"{path}: transformers wrote no tokenizer.json for it")
        import tokenizers
        built = tokenizers.Tokenizer.from_file(str(saved / "tokenizer.json"))
        size = built.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise GGUFError(f"{path}: its tokenizer has {size} tokens, more than the model's {vocab_size}")
        for file in saved.iterdir():
            if file.is_file():
                shutil.copyfile(file, out / file.name)


def _write_weights(path: Path, file: Path, plan: list[_Output]) -> None:
    """A float32 safetensors file of `plan`, written one dequantized chunk at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for o in plan:
        size = 4 * math.prod(o.shape)
        header[o.name] = {"dtype": "F32", "shape": list(o.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for o in plan:
            written = 0
            for chunk in _values(path, o):
                f.write(memoryview(chunk).cast("B"))
                written += chunk.nbytes
            if written != 4 * math.prod(o.shape):  # a plan/shape bug, never the file's fault
                raise AssertionError(f"{o.name}: wrote {written} bytes, expected {4 * math.prod(o.shape)}")


def _values(path: Path, o: _Output) -> Iterator[np.ndarray]:
    """The float32 values of output tensor `o`, in row-major chunks."""
    from gguf.quants import dequantize

    t = o.source

    def values_of(data: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):  # garbage blocks: reported as non-finite values below
            values = dequantize(data, t.tensor_type).astype(np.float32, copy=False)
        if not np.isfinite(values).all():
            raise GGUFError(f"{path}: tensor {t.name} holds non-finite values (a corrupt file?)")
        return values

    data = t.data if o.expert is None else t.data[o.expert]
    if o.permute_heads is not None:  # whole tensor: its rows move between chunks
        yield np.ascontiguousarray(_unpermute(values_of(data).reshape(o.shape), o.permute_heads))
        return
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    step = max(1, _CHUNK_ELEMENTS // max(o.shape[-1] if o.shape else 1, 1))
    for start in range(0, rows.shape[0], step):
        yield np.ascontiguousarray(values_of(rows[start:start + step]))


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` of Q/K rows (weights [out, in] or bias [out]):
    per head, rows stored as (half-dim, pair) go back to (pair, half-dim), as transformers does.
    (`_check_plan` made the rows heads x an even head_dim.)"""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
