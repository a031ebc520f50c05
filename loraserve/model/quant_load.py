"""Which quantization a base is served with (`--quantize`), applied at load.

`apply(model, model_dir, setting, group, dtype)` runs after the weights are loaded and before
q/k/v and gate/up are fused (fusing stacks QuantLinears as it stacks linears):

- `auto` (the default): a base converted from a GGUF file whose linears are quantized is served
  with the file's own blocks repacked (model/quant_gguf.py), unless `--dtype` names a float
  dtype; an AWQ/GPTQ checkpoint as loaded, its linears already QuantLinears (model/quant_hf.py,
  built by the loader); anything else is served as loaded.
- `none` (`--dequantize`): float weights (a GGUF file's dequantized, as before; an AWQ/GPTQ
  checkpoint's linears dequantized at load to the model's dtype).
- `int8` / `int4`: every linear quantized from the loaded float weights (`--quantize-group`),
  routed experts included (model/quant_moe.py; a MoE router stays float);
  refused for an AWQ/GPTQ checkpoint, which is quantized already.

Returns the name of the quantization ("gguf-Q4_1+Q8_0", "int4-g64", "awq-int4-g128", ...), which
the served base's fingerprint carries (catalog.base.served_fingerprint), or None.
"""
from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from .moe import ExpertLinear, SparseMoeBlock
from .quant import QuantError, QuantLinear, Scheme, quant_linear_of
from .quant_gguf import FLOAT_TYPES, linear_types, repack_gguf, source_file
from .quant_hf import read_quantization
from .quant_moe import QuantExpertLinear

log = logging.getLogger(__name__)

SETTINGS = ("auto", "none", "int8", "int4")


def apply(model: nn.Module, model_dir: str | Path, setting: str, group: int | None, dtype: str) -> str | None:
    """Quantize model's linears in place as `setting` asks (module doc); the scheme's name or None."""
    checkpoint = read_quantization(model_dir)
    if checkpoint is not None:
        return _checkpoint_quantization(model, setting, checkpoint.name)
    if setting == "none":
        return None
    if setting == "auto":
        source = source_file(model_dir)
        if source is None or dtype != "auto" or not linear_types(source) - set(FLOAT_TYPES):
            return None
        name = repack_gguf(model, source, model.config.arch)
        log.info("base served quantized from %s: %s (%d quantized linears)", source, name, _count(model))
        return name
    scheme = Scheme.parse(setting, group)
    swaps = [(parent, attr, child) for parent in model.modules()
             for attr, child in parent.named_children() if type(child) in (nn.Linear, ExpertLinear)
             and not (isinstance(parent, SparseMoeBlock) and attr == "gate")]  # the router stays float
    for parent, attr, child in swaps:
        try:
            quantized = (QuantExpertLinear.of(child, scheme) if isinstance(child, ExpertLinear)
                         else quant_linear_of(child, scheme))
            setattr(parent, attr, quantized)
        except QuantError as e:
            log.warning("%s stays float: %s", attr, e)
    log.info("base served quantized: %s (%d quantized linears)", scheme.name, _count(model))
    return scheme.name


def _checkpoint_quantization(model: nn.Module, setting: str, name: str) -> str | None:
    """An AWQ/GPTQ checkpoint's linears (QuantLinears from the loader): kept (`auto`), made
    float (`none`); `int8`/`int4` refused."""
    if setting in ("int8", "int4"):
        raise QuantError(f"--quantize {setting}: the checkpoint is quantized already ({name}); serve it as "
                         "it is (the default) or dequantized (--dequantize)")
    if setting == "auto":
        log.info("base served quantized: %s (%d quantized linears)", name, _count(model))
        return name
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight = nn.Parameter(child.dequantized(dtype), requires_grad=False)
                plain.bias = child.bias
                setattr(parent, attr, plain)
    log.info("base served dequantized: the %s checkpoint's linears as float weights", name)
    return None


def _count(model: nn.Module) -> int:
    return sum(isinstance(m, QuantLinear) for m in model.modules())
