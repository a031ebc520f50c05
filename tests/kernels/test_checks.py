"""Backend resolution and launcher input checks: bad input gets a clear error."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import add_lora, expand, resolve_backend, shrink
from loraserve.kernels._triton import interpreted
from loraserve.kernels.shrink import _shrink_kernel


def test_resolve_backend(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("triton", "cuda:0") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if interpreted(_shrink_kernel):  # CPU CI: triton was imported under the interpreter
        assert resolve_backend("triton", "cpu") == "triton"
    else:  # CUDA machine: compiled kernels cannot switch to the interpreter afterwards
        with pytest.raises(ValueError, match="before triton is imported"):
            resolve_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        resolve_backend("cuda", "cpu")


@pytest.fixture
def case(make_case, device):
    slots = torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    return make_case(device=device, ranks=[2, 4], slots=slots, h_in=8, h_out=6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shape_dtype_and_layout_errors(case, backend):
    c = case
    v = torch.zeros(4, 4, device=c.x.device)
    with pytest.raises(ValueError, match="x must be"):
        shrink(v, c.x[:3], c.A_rows, c.row_table, c.ranks, c.meta, backend=backend)
    with pytest.raises(ValueError, match="A_rows is torch.float16"):
        shrink(v, c.x, c.A_rows.half(), c.row_table, c.ranks, c.meta, backend=backend)
    with pytest.raises(ValueError, match="A_rows rows have width"):
        shrink(v, c.x, c.A_rows[:, :5], c.row_table, c.ranks, c.meta, backend=backend)
    with pytest.raises(ValueError, match="dense"):
        shrink(v, c.x, c.A_rows[:, None], c.row_table, c.ranks, c.meta, backend=backend)
    with pytest.raises(ValueError, match="row_table"):
        shrink(v, c.x, c.A_rows, c.row_table.long(), c.ranks, c.meta, backend=backend)
    with pytest.raises(ValueError, match="ranks"):
        shrink(v, c.x, c.A_rows, c.row_table, c.ranks[:1], c.meta, backend=backend)
    with pytest.raises(ValueError, match="v has width"):
        shrink(torch.zeros(4, 3, device=c.x.device), c.x, c.A_rows, c.row_table, c.ranks, c.meta,
               backend=backend)
    with pytest.raises(ValueError, match="unit stride"):
        expand(c.y.t().contiguous().t(), v, c.B_rows, c.row_table, c.ranks, c.meta,
               backend=backend)
    with pytest.raises(ValueError, match="v must be float32"):
        expand(c.y, v.half(), c.B_rows, c.row_table, c.ranks, c.meta, backend=backend)
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        add_lora(c.y, c.x, c.A_rows, c.B_rows, c.row_table, c.ranks, c.meta, backend="cuda")


def test_torch_backend_rejects_rank_above_table(case):
    c = case
    ranks = torch.tensor([2, 9], dtype=torch.int32, device=c.x.device)
    with pytest.raises(ValueError, match="R_max"):
        add_lora(c.y, c.x, c.A_rows, c.B_rows, c.row_table, ranks, c.meta, backend="torch")
