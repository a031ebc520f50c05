"""What the catalog needs to know about a base model directory, read from disk without loading it.

`BaseInfo.from_dir(model_dir)` reads `config.json` and the safetensors headers (single file or
sharded with `model.safetensors.index.json`) and lists every LoRA-targetable module with its
(in, out) features. Experts are found either per expert on disk
(`model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, what transformers writes) or fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`). An AWQ/GPTQ
checkpoint's quantized linears (`X.qweight`, `X.scales`; model/quant_hf.py) count as `X.weight`.

`base_fingerprint(model_dir)` is xxh3-128 over the canonical JSON of the architecture keys
and every tensor in sorted name order (name, dtype, shape, bytes), streamed from mmap, so a
sharded and a single-file checkpoint of the same weights agree.
"""
from __future__ import annotations

import json
import mmap
import re
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .checkpoint import TensorEntry, parse_weight_name, read_tensor_index, weight_name
from .dtypes import name_of_code
from .targets import DENSE_KINDS, LM_HEAD, module_path, parse_expert_plane_path, parse_module_path

ARCHES = ("qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mistral")
ARCH_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
    "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "rms_norm_eps", "rope_theta", "rope_scaling", "hidden_act", "tie_word_embeddings",
    "attention_bias", "shared_expert_intermediate_size", "sliding_window", "max_window_layers",
)
# transformers' fused expert tensors: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(slots=True)
class ModuleInfo:
    """A LoRA-targetable base module: y = x @ W^T with W [out, in] (experts: W [E, out, in])."""

    in_features: int
    out_features: int
    experts: int  # 0 for a dense module
    sources: tuple[str, ...]  # checkpoint tensor names; per-expert modules list one per expert
    rows: tuple[int, int] | None = None  # slice of dim -2 in a fused gate_up tensor


def normalize_config(config: dict) -> dict:
    """The architecture-relevant config keys, normalized across transformers versions."""
    cfg = dict(config)
    cfg["num_experts"] = cfg.get("num_experts", cfg.get("num_local_experts"))
    rope = dict(cfg.get("rope_parameters") or {})
    cfg["rope_theta"] = cfg.get("rope_theta", rope.pop("rope_theta", None))
    if rope and rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    if cfg.get("model_type") == "mistral":  # Mistral masks by sliding_window whenever it is set
        cfg["max_window_layers"] = None
    elif not cfg.get("use_sliding_window"):  # a window the model does not apply is no architecture
        cfg["sliding_window"] = cfg["max_window_layers"] = None
    return {k: cfg[k] for k in ARCH_KEYS if cfg.get(k) is not None}


def read_config(model_dir: str | Path) -> dict:
    """`config.json` of a base directory; FileNotFoundError / ValueError with the path on failure."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    return json.loads(path.read_text())


class QuantizedFingerprint(str):
    """The fingerprint of a base served quantized: `<float base's fingerprint>+<quantization>`
    (`+gguf-Q4_1+Q8_0`, `+int4-g64`), so what is exported from it (a trained adapter) names the
    weights it saw. `accepts(fp)` says which adapters' bases it serves: its own, and the float
    base's where the weights are the same (a GGUF repack: lossless) or `allow_float` says so."""

    float_fingerprint: str
    allow_float: bool

    def __new__(cls, float_fingerprint: str, quantization: str, allow_float: bool) -> "QuantizedFingerprint":
        self = super().__new__(cls, f"{float_fingerprint}+{quantization}")
        self.float_fingerprint, self.allow_float = float_fingerprint, allow_float
        return self

    def __reduce__(self):
        return (QuantizedFingerprint, (self.float_fingerprint, self.removeprefix(self.float_fingerprint + "+"),
                                       self.allow_float))

    def accepts(self, fingerprint: str) -> bool:
        return fingerprint == self or (self.allow_float and fingerprint == self.float_fingerprint)


# a GGUF file's blocks repacked (model.quant_gguf) are the weights its dequantized base holds;
# an AWQ/GPTQ checkpoint (model.quant_hf) has no weights but its quantized ones, which
# --dequantize serves as floats
LOSSLESS_QUANTIZATION_PREFIX = ("gguf-", "awq-", "gptq-")


def served_fingerprint(float_fingerprint: str, quantization: str | None, allow_float: bool) -> str:
    """The fingerprint adapters are checked against: the float base's for a float base, else a
    `QuantizedFingerprint` that takes the float base's adapters when the quantization is lossless
    or `allow_float` (--allow-quantized-base-adapters)."""
    if quantization is None:
        return float_fingerprint
    lossless = quantization.startswith(LOSSLESS_QUANTIZATION_PREFIX)
    return QuantizedFingerprint(float_fingerprint, quantization, allow_float or lossless)


def trained_fingerprint(served: str) -> str:
    """The base fingerprint a revision trained on the served base records: the served one (an
    adapter fit to `--quantize int8|int4` weights names them: it serves on that base, and on
    the float base only as another base's), save where the quantization is lossless
    (LOSSLESS_QUANTIZATION_PREFIX: a GGUF file's blocks, an AWQ/GPTQ checkpoint's own weights):
    there the float fingerprint, which both the quantized and the dequantized base serve."""
    if isinstance(served, QuantizedFingerprint) and served.removeprefix(
            served.float_fingerprint + "+").startswith(LOSSLESS_QUANTIZATION_PREFIX):
        return served.float_fingerprint
    return str(served)


def base_fingerprint(model_dir: str | Path) -> str:
    """xxh3-128 hex of the architecture config and all weight bytes (streamed via mmap)."""
    model_dir = Path(model_dir)
    h = xxhash.xxh3_128()
    h.update(json.dumps(normalize_config(read_config(model_dir)), sort_keys=True, separators=(",", ":")).encode())
    index = read_tensor_index(model_dir)
    maps: dict[Path, tuple] = {}
    try:
        for name in sorted(index):
            e = index[name]
            if e.file not in maps:
                f = open(e.file, "rb")
                maps[e.file] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            h.update(f"{name}\0{e.dtype}\0{list(e.shape)}\0".encode())
            view = memoryview(maps[e.file][1])
            h.update(view[e.start : e.end])
            view.release()
    finally:
        for f, m in maps.values():
            m.close()
            f.close()
    return h.hexdigest()


def _layer_kind(name: str) -> str | None:
    """The target kind whose module weight checkpoint tensor `name` is, or None."""
    path = parse_weight_name(name)
    try:
        return parse_module_path(path)[0] if path else None
    except ValueError:
        return None


def _dense_modules(index: dict[str, TensorEntry]) -> dict[str, ModuleInfo]:
    modules = {}
    for name, e in index.items():
        kind = _layer_kind(name)
        if kind in DENSE_KINDS and len(e.shape) == 2:
            modules[parse_weight_name(name)] = ModuleInfo(e.shape[1], e.shape[0], 0, (name,))
    return modules


def _quantized_modules(index: dict[str, TensorEntry], config: dict) -> dict[str, ModuleInfo]:
    """AWQ/GPTQ linears: out from `X.scales` [K / G, N], in from `X.qweight` ([K, N / 8] AWQ,
    [K / 8, N] GPTQ)."""
    gptq = (config.get("quantization_config") or {}).get("quant_method") == "gptq"
    modules = {}
    for name, e in index.items():
        stem = name.removesuffix("qweight")
        scales = index.get(stem + "scales")
        if stem != name and _layer_kind(stem + "weight") in DENSE_KINDS and scales is not None:
            in_features = e.shape[0] * (8 if gptq else 1)
            modules[parse_weight_name(stem + "weight")] = ModuleInfo(in_features, scales.shape[1], 0, (name,))
    return modules


def _fused_expert_modules(index: dict[str, TensorEntry]) -> dict[str, ModuleInfo]:
    modules = {}
    for name, e in index.items():
        m = _FUSED_EXPERTS.match(name)
        if not m or len(e.shape) != 3:
            continue
        layer, (experts, rows, cols) = int(m[1]), e.shape
        if m[2] == "down_proj":
            modules[module_path("experts.down_proj", layer)] = ModuleInfo(cols, rows, experts, (name,))
        else:
            half = rows // 2
            modules[module_path("experts.gate_proj", layer)] = ModuleInfo(cols, half, experts, (name,), (0, half))
            modules[module_path("experts.up_proj", layer)] = ModuleInfo(cols, half, experts, (name,), (half, rows))
    return modules


def _per_expert_modules(index: dict[str, TensorEntry]) -> dict[str, ModuleInfo]:
    per_expert: dict[str, dict[int, str]] = {}
    for name in index:
        path = parse_weight_name(name)
        plane = parse_expert_plane_path(path) if path else None
        if plane:
            per_expert.setdefault(plane[0], {})[plane[1]] = name
    modules = {}
    for path, by_expert in per_expert.items():
        names = tuple(by_expert[e] for e in sorted(by_expert))
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{path}: experts on disk are not numbered 0..{len(by_expert) - 1}")
        shape = index[names[0]].shape
        if any(index[n].shape != shape for n in names):
            raise ValueError(f"{path}: experts have different shapes")
        modules[path] = ModuleInfo(shape[1], shape[0], len(names), names)
    return modules


def _lm_head(index: dict[str, TensorEntry], config: dict) -> dict[str, ModuleInfo]:
    head = weight_name(LM_HEAD)
    for name in (head, "model.embed_tokens.weight"):
        if name in index and (name == head or config.get("tie_word_embeddings")):
            vocab, hidden = index[name].shape
            return {LM_HEAD: ModuleInfo(hidden, vocab, 0, (name,))}
    return {}


def _bulk_dtype(index: dict[str, TensorEntry]) -> str:
    """Dtype name of most float tensors (an AWQ/GPTQ checkpoint's int32 codes are not the
    weights' dtype); float32 when there are none."""
    codes = [e.dtype for e in index.values() if name_of_code(e.dtype)]
    return (name_of_code(max(set(codes), key=codes.count)) if codes else None) or "float32"


@dataclass(slots=True)
class BaseInfo:
    """A base model as the catalog sees it: arch, sizes, targetable modules, fingerprint."""

    model_dir: Path
    arch: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_experts: int  # 0 for a dense model
    dtype: str  # dtype name of the bulk of the weights, e.g. "float32"
    fingerprint: str
    modules: dict[str, ModuleInfo] = field(default_factory=dict)  # blob module path -> info

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"{self.model_dir}: unsupported architecture {self.arch!r}; known: {', '.join(ARCHES)}")
        if not self.modules:
            raise ValueError(f"{self.model_dir}: no LoRA-targetable weights found")

    @classmethod
    def from_dir(cls, model_dir: str | Path, fingerprint: str | None = None) -> BaseInfo:
        """Read config + headers; hash the weights unless `fingerprint` is given (already known)."""
        model_dir = Path(model_dir)
        config = read_config(model_dir)
        index = read_tensor_index(model_dir)
        modules = {**_dense_modules(index), **_quantized_modules(index, config), **_fused_expert_modules(index),
                   **_per_expert_modules(index), **_lm_head(index, config)}
        norm = normalize_config(config)
        return cls(
            model_dir=model_dir,
            arch=str(config.get("model_type")),
            num_layers=int(norm.get("num_hidden_layers", 0)),
            hidden_size=int(norm.get("hidden_size", 0)),
            vocab_size=int(norm.get("vocab_size", 0)),
            num_experts=int(norm.get("num_experts") or 0),
            dtype=_bulk_dtype(index),
            fingerprint=fingerprint or base_fingerprint(model_dir),
            modules=modules,
        )

    def paths_for(self, kind: str) -> list[str]:
        """Module paths of one target kind, in layer order (`lm_head` -> `["lm_head"]`)."""
        found = [(parse_module_path(p), p) for p in self.modules]
        return [p for (k, layer), p in sorted(found, key=lambda x: x[0][1] or 0) if k == kind]
