"""Which quantization a base is served with (`--quantize`), applied at load.

`apply(model, model_dir, setting, group, dtype)` runs after the weights are loaded and before
q/k/v and gate/up are fused (fusing stacks QuantLinears as it stacks linears):

- `auto` (the default): a base converted from a GGUF file whose linears are quantized is served
  with the file's own blocks repacked (model/quant_gguf.py), unless `--dtype` names a float
  dtype; anything else is served as loaded.
- `none` (`--dequantize`): as loaded (a GGUF file's weights dequantized to float, as before).
- `int8` / `int4`: every linear quantized from the loaded float weights (`--quantize-group`).

Returns the name of the quantization ("gguf-Q4_1+Q8_0", "int4-g64", ...), which the served
base's fingerprint carries (catalog.base.served_fingerprint), or None.
"""
from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from .quant import QuantError, QuantLinear, Scheme, quant_linear_of
from .quant_gguf import REPACKED, linear_types, repack_gguf, source_file

log = logging.getLogger(__name__)

SETTINGS = ("auto", "none", "int8", "int4")


def apply(model: nn.Module, model_dir: str | Path, setting: str, group: int | None, dtype: str) -> str | None:
    """Quantize model's linears in place as `setting` asks (module doc); the scheme's name or None."""
    if setting == "none":
        return None
    if setting == "auto":
        source = source_file(model_dir)
        if source is None or dtype != "auto" or not linear_types(source) & set(REPACKED):
            return None
        name = repack_gguf(model, source, model.config.arch)
        log.info("base served quantized from %s: %s (%d quantized linears)", source, name, _count(model))
        return name
    scheme = Scheme.parse(setting, group)
    swaps = [(parent, attr, child) for parent in model.modules()
             for attr, child in parent.named_children() if type(child) is nn.Linear]
    for parent, attr, child in swaps:
        try:
            setattr(parent, attr, quant_linear_of(child, scheme))
        except QuantError as e:
            log.warning("%s stays float: %s", attr, e)
    log.info("base served quantized: %s (%d quantized linears)", scheme.name, _count(model))
    return scheme.name


def _count(model: nn.Module) -> int:
    return sum(isinstance(m, QuantLinear) for m in model.modules())
