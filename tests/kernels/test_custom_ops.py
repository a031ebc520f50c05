"""The LoRA ops as torch custom ops (`torch.ops.loraserve.*`): torch.compile traces a module that
calls them in one graph, opcheck accepts their registration, and the op path matches eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from loraserve.kernels import LoRAMeta, add_lora, expand, shrink
from loraserve.kernels.reference import add_lora_ref


class TinyLoRA(nn.Module):
    """y = 2 * (x @ W^T + LoRA(x)): a base linear, the LoRA op in place on its output, and a
    torch op after it (the compiled graph must keep the in-place update's order)."""

    def __init__(self, case, backend: str, split: bool):
        super().__init__()
        h_in, h_out = case.x.shape[1], case.y.shape[1]
        self.base = nn.Linear(h_in, h_out, bias=False, device=case.x.device).requires_grad_(False)
        for name in ("A_rows", "B_rows", "row_table", "ranks"):
            self.register_buffer(name, getattr(case, name))
        self.backend, self.split = backend, split

    def forward(self, x: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
        y = self.base(x)
        if self.split:  # the two halves as separate ops, v allocated in the graph
            v = x.new_empty(x.shape[0], self.row_table.shape[1], dtype=torch.float32)
            shrink(v, x, self.A_rows, self.row_table, self.ranks, meta, backend=self.backend)
            expand(y, v, self.B_rows, self.row_table, self.ranks, meta, backend=self.backend)
        else:
            add_lora(y, x, self.A_rows, self.B_rows, self.row_table, self.ranks, meta,
                     backend=self.backend)
        return y * 2


def _case(make_case, device):
    slots = torch.tensor([1, -1, 0, 1, 2], dtype=torch.int32)
    return make_case(device=device, ranks=[4, 16, 7], slots=slots, h_in=24, h_out=20, seed=21)


@pytest.mark.parametrize("split", [False, True], ids=["add_lora", "shrink+expand"])
def test_torch_compile_one_graph(split, device, backend, make_case, assert_rel):
    torch._dynamo.reset()
    case = _case(make_case, device)
    module = TinyLoRA(case, backend, split)
    eager = module(case.x, case.meta)
    want = module.base(case.x)
    add_lora_ref(want, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks, case.slots)
    assert_rel(eager, 2 * want, torch.float32)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # a break would raise
    assert_rel(compiled(case.x, case.meta), eager, torch.float32)
    # the LoRA ops are nodes of the one traced graph, not opaque Python
    explained = torch._dynamo.explain(module)(case.x, case.meta)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    code = explained.graphs[0].code
    for op in (("shrink", "expand") if split else ("add_lora",)):
        assert f"torch.ops.loraserve.{op}" in code


def _op_args(case, backend: str):
    meta = case.meta
    v = torch.zeros(case.x.shape[0], case.row_table.shape[1], device=case.x.device)
    common = (case.row_table, case.ranks, meta.tensors(), meta.num_tokens, meta.moe, backend)
    return {
        torch.ops.loraserve.shrink.default: (v, case.x, case.A_rows, *common),
        torch.ops.loraserve.expand.default: (case.y.clone(), torch.randn_like(v), case.B_rows,
                                             *common),
        torch.ops.loraserve.add_lora.default: (case.y.clone(), case.x, case.A_rows, case.B_rows,
                                               case.row_table, case.ranks, v.clone(),
                                               *common[2:]),
    }


def test_opcheck(device, backend, make_case):
    case = _case(make_case, device)
    for op, args in _op_args(case, backend).items():
        torch.library.opcheck(op, args)


def test_op_matches_eager_call(device, backend, make_case):
    case = _case(make_case, device)
    y = case.y.clone()
    add_lora(y, case.x, case.A_rows, case.B_rows, case.row_table, case.ranks, case.meta,
             backend=backend)
    y_op = case.y.clone()
    meta = case.meta
    torch.ops.loraserve.add_lora(y_op, case.x, case.A_rows, case.B_rows, case.row_table,
                                 case.ranks, None, meta.tensors(), meta.num_tokens, meta.moe,
                                 backend)
    assert torch.equal(y, y_op)


def test_fake_tensors_check_shapes(make_case):
    # Under FakeTensorMode the public functions go through the ops' fake implementations: no
    # kernel runs, and bad shapes fail while tracing with the launchers' errors.
    case = _case(make_case, "cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {name: mode.from_tensor(getattr(case, name))
                for name in ("x", "y", "A_rows", "B_rows", "row_table", "ranks")}
        meta = LoRAMeta(*(mode.from_tensor(t) for t in case.meta.tensors()),
                        case.meta.num_tokens, case.meta.moe)
        add_lora(fake["y"], fake["x"], fake["A_rows"], fake["B_rows"], fake["row_table"],
                 fake["ranks"], meta, backend="triton")
        with pytest.raises(ValueError, match="A_rows rows have width"):
            add_lora(fake["y"], fake["x"], fake["A_rows"][:, :5], fake["B_rows"],
                     fake["row_table"], fake["ranks"], meta, backend="torch")
        with pytest.raises(ValueError, match="unknown LoRA backend"):
            add_lora(fake["y"], fake["x"], fake["A_rows"], fake["B_rows"], fake["row_table"],
                     fake["ranks"], meta, backend="cuda")
