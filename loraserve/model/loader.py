"""Load a Hugging Face checkpoint directory of any supported architecture into `CausalLM`.

The model is built on the meta device and each parameter is assigned once, already converted to
its dtype and device, so the weights are never materialised twice. Only safetensors are read.
The checkpoint must hold exactly the tensors the model uses: one that is missing, or one the model
has no place for (another architecture's bias, an extra head), is refused by name before any
tensor bytes are read.

An AWQ or GPTQ checkpoint (config.json's `quantization_config`, model/quant_hf.py) holds
`X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`) in place of a linear's `X.weight`:
each such linear is built as a `QuantLinear` from them, never as a float weight, and a MoE
layer's experts so stored as a `QuantExpertLinear` of them (model/quant_moe.py); experts whose
inputs are no multiple of the kernel's step are read as their dequantized float weights.
"""
from __future__ import annotations

import logging
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from loraserve.catalog.checkpoint import read_tensor_index
from loraserve.catalog.dtypes import SERVING_DTYPES, dtype_name, torch_dtype
from loraserve.model import quant_hf
from loraserve.model.quant import CHUNK
from loraserve.model.quant_moe import QuantExpertLinear
from loraserve.model.checkpoint import CheckpointError, expert_tensor_name
from loraserve.model.config import ModelConfig
from loraserve.model.transformer import CausalLM

log = logging.getLogger(__name__)

# buffers old checkpoints carry that the model recomputes (transformers skips them as well)
_RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_NAMES_SHOWN = 5


def resolve_dtype(name: str, config: ModelConfig, device: str | torch.device) -> torch.dtype:
    """"auto" -> float32 on CPU, the checkpoint's dtype (or bfloat16) on CUDA; else the named one."""
    if name == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        return torch_dtype(config.torch_dtype or "bfloat16")  # ModelConfig admits serving dtypes only
    if name not in SERVING_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(SERVING_DTYPES)}")
    return torch_dtype(name)


class _TensorSource:
    """Reads checkpoint tensors by name across shard files, opening each file once. In an AWQ/GPTQ
    checkpoint (`quantization`) a quantized linear's `X.weight` is listed in place of its parts
    (quant_hf.PARTS), and `get` reads it dequantized (MoE experts)."""

    def __init__(self, model_dir: Path, stack: ExitStack, quantization: quant_hf.HFQuantization | None = None):
        self.model_dir = model_dir
        self._files = {name: entry.file for name, entry in read_tensor_index(model_dir).items()}
        self._stack = stack
        self._open: dict[Path, object] = {}
        self.quantization = quantization
        self.quantized = quant_hf.quantized_weights(self._files) if quantization else {}  # X.weight -> X

    def __contains__(self, name: str) -> bool:
        return name in self._files or name in self.quantized

    def names(self) -> list[str]:
        plain = [n for n in self._files if not (self.quantized and quant_hf.is_part(n))]
        return plain + list(self.quantized)

    def quantized_part(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A part of a quantized linear (quant_hf.Read)."""
        return self._read(name, torch.Size(shape))

    def get(self, name: str, shape: torch.Size) -> Tensor:
        """The CPU tensor `name`, checked against `shape`."""
        if name in self.quantized and name not in self._files:
            return self.quantized_linear(name, shape, None, torch.float32, torch.device("cpu")).weight
        return self._read(name, shape)

    def quantized_linear(self, name: str, shape: torch.Size, bias: Tensor | None, dtype: torch.dtype,
                         device: torch.device) -> torch.nn.Module:
        """The served layer of quantized weight `name` [out, in] (quant_hf.quant_linear)."""
        prefix = self.quantized[name]
        n, k = shape
        return quant_hf.quant_linear(self.quantization, self.quantized_part, prefix, n, k,
                                     self._files[f"{prefix}.qweight"], f"{prefix}.g_idx" in self._files,
                                     bias, dtype, device)

    def _read(self, name: str, shape: torch.Size) -> Tensor:
        if name not in self._files:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        file = self._files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        t = self._open[file].get_tensor(name)
        if t.shape != shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, "
                                  f"expected {list(shape)} from config.json")
        return t


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> CausalLM:
    """Build the model described by `model_dir/config.json` and load its safetensors weights.

    Handles single-file and sharded (index.json) checkpoints, per-expert MoE tensors (packed into
    ExpertLinear.weight [E, out, in]) and tied embeddings. As in transformers 5, a stored
    `lm_head.weight` is the head (even where config.json says tied) and none means tied.
    Returns the model in eval mode with requires_grad off.
    """
    model_dir, device = Path(model_dir), torch.device(device)
    dtype_name(dtype)  # ValueError unless a serving dtype
    config = ModelConfig.from_dir(model_dir)
    with ExitStack() as stack:
        source = _TensorSource(model_dir, stack, quant_hf.read_quantization(model_dir))
        config.tie_word_embeddings = "lm_head.weight" not in source
        model = CausalLM(config, device="meta")
        params = list(model.named_parameters())
        _check_names(source, [n for name, p in params for n, _ in _checkpoint_names(name, p.shape)],
                     config.arch)
        quantized = {name: p.shape for name, p in params
                     if name in source.quantized or _quantized_experts(source, name, p.shape)}
        for name, param in params:
            if name not in quantized:
                value = _read_param(source, name, param.shape, dtype, device)
                _assign(model, name, torch.nn.Parameter(value, requires_grad=False))
        _build_quantized(model, source, quantized, dtype, device)  # after the biases, which they take
    model.tie_weights()
    model.model.rotary_emb.reset_buffers(device)
    return model.eval()


def _checkpoint_names(name: str, shape: torch.Size) -> list[tuple[str, torch.Size]]:
    """(checkpoint tensor name, shape) that parameter `name` is read from: itself, or one per
    expert for a packed expert weight [E, out, in]."""
    if expert_tensor_name(name, 0) is None:
        return [(name, shape)]
    return [(expert_tensor_name(name, e), shape[1:]) for e in range(shape[0])]


def _build_quantized(model: CausalLM, source: _TensorSource, quantized: dict[str, torch.Size],
                     dtype: torch.dtype, device: torch.device) -> None:
    """Each quantized weight's module replaced by its served layer, built from the parts: a
    linear's (with the loaded bias), a QuantExpertLinear of an ExpertLinear's experts."""
    for name, shape in quantized.items():
        owner = name.rpartition(".")[0]
        if name in source.quantized:
            bias = getattr(model.get_submodule(owner), "bias", None)
            _assign(model, owner, source.quantized_linear(name, shape, bias, dtype, device))
        else:
            _assign(model, owner, QuantExpertLinear([source.quantized_linear(n, plane, None, dtype, device)
                                                     for n, plane in _checkpoint_names(name, shape)]))
    read_float = len(source.quantized) - sum(1 if n in source.quantized else s[0] for n, s in quantized.items())
    if read_float:
        log.info("%s: %d quantized MoE expert weights read as their dequantized float weights (their "
                 "inputs are no multiple of %d)", source.model_dir, read_float, CHUNK)


def _quantized_experts(source: _TensorSource, name: str, shape: torch.Size) -> bool:
    """Whether packed expert weight `name` [E, out, in] is stored quantized, every expert, with
    inputs the kernel takes (else it is read dequantized)."""
    names = _checkpoint_names(name, shape)
    return (expert_tensor_name(name, 0) is not None and shape[-1] % CHUNK == 0
            and all(n in source.quantized for n, _ in names))


def _check_names(source: _TensorSource, wanted: list[str], arch: str) -> None:
    """CheckpointError naming the tensors the model needs and the checkpoint lacks, or the
    tensors the checkpoint has and the model does not use."""
    want = set(wanted)
    missing = [n for n in wanted if n not in source]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {_listing(missing)}, which config.json's "
                              f"{arch} model needs")
    unused = sorted(n for n in source.names() if n not in want and not _RECOMPUTED.search(n))
    if unused:
        raise CheckpointError(f"checkpoint has tensor {_listing(unused)}, which config.json's {arch} "
                              "model does not use (a checkpoint of another architecture?)")


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _read_param(source: _TensorSource, name: str, shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    if expert_tensor_name(name, 0) is None:
        return source.get(name, shape).to(device=device, dtype=dtype)
    out = torch.empty(shape, dtype=dtype, device=device)          # [E, out, in]
    for e, (tensor_name, plane) in enumerate(_checkpoint_names(name, shape)):
        out[e].copy_(source.get(tensor_name, plane))
    return out


def _assign(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner_name), attr, value)
