"""LoRAMeta.build: grouping, segment bounds, unused segments, preallocated reuse, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from loraserve.kernels import LoRAMeta


def _segments(meta: LoRAMeta) -> list[tuple[int, int, list[int]]]:
    starts = meta.seg_start.tolist()
    out = []
    for s in range(int(meta.num_segments)):
        toks = meta.token_ids[starts[s]:starts[s + 1]].tolist()
        out.append((int(meta.seg_slot[s]), int(meta.seg_expert[s]), toks))
    return out


def test_dense_groups_tokens_by_slot(device):
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0, 5], dtype=torch.int32, device=device)
    meta = LoRAMeta.build(slots, max_segments=6)
    assert _segments(meta) == [(0, 0, [2, 6]), (2, 0, [0, 3, 4]), (5, 0, [7])]
    assert meta.seg_start.tolist() == [0, 2, 5, 6, 6, 6, 6]
    assert meta.seg_slot.tolist()[3:] == [-1, -1, -1]
    assert sorted(meta.token_ids.tolist()[6:]) == [1, 5]  # base-only tokens come last
    assert meta.sorted_slots.tolist() == [0, 0, 2, 2, 2, 5, -1, -1]
    assert meta.num_tokens == 8 and not meta.moe


def test_moe_groups_by_slot_then_expert(device):
    slots = torch.tensor([1, 1, 0, 1, -1, 0], dtype=torch.int32, device=device)
    experts = torch.tensor([3, 0, 3, 3, 2, 3], dtype=torch.int32, device=device)
    meta = LoRAMeta.build(slots, max_segments=8, token_experts=experts)
    assert _segments(meta) == [(0, 3, [2, 5]), (1, 0, [1]), (1, 3, [0, 3])]
    assert meta.moe and int(meta.seg_start[-1]) == 5


def test_no_lora_tokens_make_no_segments(device):
    meta = LoRAMeta.build(torch.full((5,), -1, dtype=torch.int32, device=device), max_segments=3)
    assert int(meta.num_segments) == 0
    assert meta.seg_start.tolist() == [0, 0, 0, 0]
    assert meta.seg_slot.tolist() == [-1, -1, -1]


def test_build_into_preallocated_buffers(device):
    out = LoRAMeta.empty(16, 4, device)
    ptr = out.token_ids.data_ptr()
    first = LoRAMeta.build(torch.tensor([3, 3, 1], dtype=torch.int32, device=device),
                           max_segments=4, out=out)
    assert first is out and out.num_tokens == 3 and out.token_ids.data_ptr() == ptr
    LoRAMeta.build(torch.tensor([0, -1, 2, 0, 2], dtype=torch.int32, device=device),
                   max_segments=4, out=out)
    assert _segments(out) == [(0, 0, [0, 3]), (2, 0, [2, 4])]
    assert out.seg_slot.tolist() == [0, 2, -1, -1] and out.num_tokens == 5


def test_empty_batch(device):
    meta = LoRAMeta.build(torch.zeros(0, dtype=torch.int32, device=device), max_segments=2)
    assert meta.num_tokens == 0 and meta.seg_start.tolist() == [0, 0, 0]


def test_bad_inputs_raise_clear_errors():
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="exceed max_segments"):
        LoRAMeta.build(slots, max_segments=2)
    with pytest.raises(ValueError, match="max_segments must be >= 1"):
        LoRAMeta.build(slots, max_segments=0)
    with pytest.raises(ValueError, match="1-D int32"):
        LoRAMeta.build(slots.float(), max_segments=3)
    with pytest.raises(ValueError, match="token_experts"):
        LoRAMeta.build(slots, max_segments=3, token_experts=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="T_max=2"):
        LoRAMeta.build(slots, max_segments=3, out=LoRAMeta.empty(2, 3, "cpu"))
    with pytest.raises(ValueError, match="int32"):
        LoRAMeta(*(torch.zeros(3, dtype=torch.int64) for _ in range(7)))


@settings(max_examples=40, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(-1, 5), st.integers(0, 3)), max_size=40),
       st.booleans())
def test_segments_partition_lora_tokens(pairs, moe):
    slots = torch.tensor([a for a, _ in pairs], dtype=torch.int32)
    experts = torch.tensor([e for _, e in pairs], dtype=torch.int32) if moe else None
    meta = LoRAMeta.build(slots, max_segments=24, token_experts=experts)
    keys = [(a, e if moe else 0) for a, e in pairs]
    seen = []
    for slot, expert, toks in _segments(meta):
        assert toks and all(keys[t] == (slot, expert) for t in toks)
        seen += toks
    assert sorted(seen) == [t for t, (a, _) in enumerate(keys) if a >= 0]
    segment_keys = [(s, e) for s, e, _ in _segments(meta)]
    assert segment_keys == sorted(set(segment_keys))  # one segment per key, in key order
    assert sorted(meta.token_ids[: meta.num_tokens].tolist()) == list(range(len(pairs)))


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(-1, 5), st.integers(0, 3)), max_size=40),
       st.booleans(), st.integers(0, 12))
def test_from_host_equals_build(pairs, moe, extra):
    """The host-side builder (CPU decode steps) writes exactly what the device builder writes."""
    slots = [a for a, _ in pairs]
    experts = [e for _, e in pairs] if moe else None
    s_max = len({(a, e if moe else 0) for a, e in pairs if a >= 0}) + extra
    if s_max == 0:
        s_max = 1
    want = LoRAMeta.build(torch.tensor(slots, dtype=torch.int32), max_segments=s_max,
                          token_experts=None if experts is None else torch.tensor(experts, dtype=torch.int32))
    got = LoRAMeta.from_host(slots, max_segments=s_max, experts=experts)
    for name in ("token_ids", "sorted_slots", "sorted_experts", "seg_start", "seg_slot", "seg_expert",
                 "num_segments"):
        assert getattr(got, name).tolist() == getattr(want, name)[: getattr(got, name).numel()].tolist(), name
    assert (got.num_tokens, got.moe) == (want.num_tokens, want.moe)


def test_from_host_rejects_too_many_segments():
    with pytest.raises(ValueError, match="exceed max_segments"):
        LoRAMeta.from_host([0, 1, 2], max_segments=2)
