"""`LoRAOps`: the backend resolved once, when it is made (the engine makes one per device), and
its calls never resolve it again; they compute what the module functions compute."""

from __future__ import annotations

import pytest
import torch

from loraserve import kernels
from loraserve.kernels import LoRAOps, ops
from loraserve.kernels.reference import add_lora_ref


def test_the_backend_is_resolved_when_made():
    assert LoRAOps("auto", "cpu").backend == "torch"
    assert LoRAOps("auto", "cuda").backend == "triton"  # resolving touches no device
    assert LoRAOps("torch", torch.device("cuda", 0)).device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        LoRAOps("cuda", "cpu")


def test_calls_never_resolve_again(monkeypatch, device, backend, make_case, assert_rel):
    slots = torch.tensor([0, 2, -1, 1, 1, 0, -1, 2, 1], dtype=torch.int32)
    case = make_case(device=device, ranks=[2, 5, 3], slots=slots, h_in=16, h_out=12)
    lora = LoRAOps(backend, device)

    def resolve(*_args):
        raise AssertionError("resolve_backend called per op call")

    monkeypatch.setattr(ops, "resolve_backend", resolve)
    y = case.y.clone()
    lora.add_lora(y, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks, case.meta)
    v = torch.empty(case.x.shape[0], case.row_table.shape[1], device=device)
    y_split = case.y.clone()
    lora.shrink(v, case.x, case.A_rows, case.row_table, case.ranks, case.meta)
    lora.expand(y_split, v, case.B_rows, case.row_table, case.ranks, case.meta)
    monkeypatch.undo()
    y_module = case.y.clone()
    kernels.add_lora(y_module, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks,
                     case.meta, backend=backend)
    assert torch.equal(y, y_module)
    expected = case.y.clone()
    add_lora_ref(expected, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks,
                 case.slots, case.experts)
    assert_rel(y, expected, case.x.dtype)
    assert_rel(y_split, expected, case.x.dtype)
