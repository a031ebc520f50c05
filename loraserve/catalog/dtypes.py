"""The one table of dtype names: name <-> safetensors code, and which ones loraserve serves in.

A dtype *name* (`"bfloat16"`) is what records, blob metadata, `config.json`, the CLI and the
engine config use; it is also the attribute name in torch (`torch.bfloat16`). The table is
torch-free so the store, the bulk materializer and argument parsing stay light; `torch_dtype`
imports torch only when called.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One dtype: its name, safetensors code, element size, and whether loraserve serves in it."""

    name: str
    st_code: str
    itemsize: int
    serving: bool = True


DTYPES: tuple[DType, ...] = (
    DType("float32", "F32", 4),
    DType("bfloat16", "BF16", 2),
    DType("float16", "F16", 2),
    # a checkpoint may hold float64 tensors; nothing is served or stored in it
    DType("float64", "F64", 8, serving=False),
)
SERVING_DTYPES = tuple(d.name for d in DTYPES if d.serving)  # ("float32", "bfloat16", "float16")
DTYPES_BY_NAME = MappingProxyType({d.name: d for d in DTYPES})
DTYPES_BY_CODE = MappingProxyType({d.st_code: d for d in DTYPES})


def serving_dtype(name: str) -> DType:
    """The table row of serving dtype `name`; ValueError naming the serving dtypes otherwise."""
    d = DTYPES_BY_NAME.get(name)
    if d is None or not d.serving:
        raise ValueError(f"unsupported serving dtype {name!r}; use one of {', '.join(SERVING_DTYPES)}")
    return d


def name_of_code(st_code: str) -> str | None:
    """`"BF16"` -> `"bfloat16"`; None for a safetensors code not in the table."""
    d = DTYPES_BY_CODE.get(st_code)
    return d.name if d else None


def torch_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; ValueError unless `name` is a serving dtype."""
    import torch  # here, not at the top: the table must not pull torch into torch-free users

    return getattr(torch, serving_dtype(name).name)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`; ValueError unless it is a serving dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in SERVING_DTYPES:
        raise ValueError(f"unsupported serving dtype {dtype}; use one of {', '.join(SERVING_DTYPES)}")
    return name
