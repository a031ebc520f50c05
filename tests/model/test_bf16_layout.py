"""`--weight-prepack auto` at bfloat16 picks what it picks at float32: plain weights for one
sequence at a time, and for a batching server too where `cpu_gemv` reads a plain bfloat16 weight
once for a few rows (AVX512-BF16); elsewhere the packed layout for a batching server where oneDNN
has bfloat16 GEMMs (bench/RESULTS.md, issue 30 session 12 and issue 41 session 16)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels import cpu_gemv
from loraserve.model.prepack import PLAIN_MAX_BATCH, VectorLinear, can_prepack, linear_weight_bytes, weight_layout


def test_weight_layout_at_bfloat16_follows_the_batch_size_as_at_float32():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    model = nn.Sequential(nn.Linear(64, 64)).to(bf16)
    big = linear_weight_bytes(model) - 1  # the weights outgrow this last-level cache
    batching = "packed" if can_prepack(cpu, bf16) and not cpu_gemv.reads_rows_once(bf16) else "plain"
    assert weight_layout("auto", model, cpu, bf16, 64, cache_bytes=big) == batching
    assert weight_layout("auto", model, cpu, bf16, PLAIN_MAX_BATCH, cache_bytes=big) == "plain"
    assert weight_layout("auto", model, cpu, torch.float32, PLAIN_MAX_BATCH, cache_bytes=big) == "plain"
    # float32 and bfloat16 where cpu_gemv reads a few rows at once: plain for a batching server too


def test_vector_linear_one_row_at_bfloat16_equals_f_linear_to_bfloat16_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(1, 256).to(torch.bfloat16)
    want = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    linear.__class__ = VectorLinear
    with torch.no_grad():
        got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 96)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
