"""Load a Hugging Face Qwen3 / Qwen3-MoE checkpoint directory into `Qwen3ForCausalLM`.

The model is built on the meta device and each parameter is assigned once, already converted to
its dtype and device, so the weights are never materialised twice. Only safetensors are read.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from loraserve.catalog.checkpoint import read_tensor_index
from loraserve.catalog.dtypes import SERVING_DTYPES, dtype_name, torch_dtype
from loraserve.model.checkpoint import CheckpointError, expert_tensor_name
from loraserve.model.config import ModelConfig
from loraserve.model.qwen3 import Qwen3ForCausalLM


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
    """Reads checkpoint tensors by name across shard files, opening each file once."""

    def __init__(self, model_dir: Path, stack: ExitStack):
        self._files = {name: entry.file for name, entry in read_tensor_index(model_dir).items()}
        self._stack = stack
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, shape: torch.Size) -> Tensor:
        """The CPU tensor `name`, checked against `shape`."""
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
               device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """Build the model described by `model_dir/config.json` and load its safetensors weights.

    Handles single-file and sharded (index.json) checkpoints, per-expert MoE tensors (packed into
    ExpertLinear.weight [E, out, in]) and tied embeddings (tie_word_embeddings, or no lm_head.weight).
    Returns the model in eval mode with requires_grad off.
    """
    model_dir, device = Path(model_dir), torch.device(device)
    dtype_name(dtype)  # ValueError unless a serving dtype
    config = ModelConfig.from_dir(model_dir)
    with ExitStack() as stack:
        source = _TensorSource(model_dir, stack)
        if not config.tie_word_embeddings and "lm_head.weight" not in source:
            config.tie_word_embeddings = True   # transformers' rule: no lm_head -> tied
        model = Qwen3ForCausalLM(config, device="meta")
        for name, param in list(model.named_parameters()):
            value = _read_param(source, name, param.shape, dtype, device)
            _assign(model, name, torch.nn.Parameter(value, requires_grad=False))
    model.tie_weights()
    model.model.rotary_emb.reset_buffers(device)
    return model.eval()


def _read_param(source: _TensorSource, name: str, shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    if expert_tensor_name(name, 0) is None:
        return source.get(name, shape).to(device=device, dtype=dtype)
    out = torch.empty(shape, dtype=dtype, device=device)          # [E, out, in]
    for e in range(shape[0]):
        out[e].copy_(source.get(expert_tensor_name(name, e), shape[1:]))
    return out


def _assign(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner_name), attr, value)
