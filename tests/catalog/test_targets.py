"""The one target table and the one dtype table: names round-trip, unknowns are refused."""
from __future__ import annotations

import pytest
import torch

from loraserve.catalog.dtypes import (DTYPES, SERVING_DTYPES, dtype_name, name_of_code, serving_dtype,
                                      torch_dtype)
from loraserve.catalog.targets import (ALL_KINDS, DENSE_KINDS, EXPERT_KINDS, LM_HEAD, TARGET_KINDS,
                                       expert_plane_path, module_path, parse_expert_plane_path,
                                       parse_module_path, parse_targets, parse_tensor_name, tensor_names)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("layer", [0, 3, 47])
def test_every_kind_round_trips_through_module_path_and_tensor_names(kind, layer):
    want_layer = None if kind == LM_HEAD else layer
    path = module_path(kind, layer)
    assert parse_module_path(path) == (kind, want_layer)
    a_name, b_name = tensor_names(kind, layer)
    assert (a_name, b_name) == (f"{path}.lora_A", f"{path}.lora_B")
    assert parse_tensor_name(a_name) == (kind, want_layer, True)
    assert parse_tensor_name(b_name) == (kind, want_layer, False)


def test_names_follow_the_blob_contract():
    assert tensor_names("q_proj", 3) == ("layers.3.self_attn.q_proj.lora_A", "layers.3.self_attn.q_proj.lora_B")
    assert module_path("up_proj", 0) == "layers.0.mlp.up_proj"
    assert module_path("experts.down_proj", 2) == "layers.2.mlp.experts.down_proj"
    assert tensor_names(LM_HEAD, 5) == ("lm_head.lora_A", "lm_head.lora_B")


def test_table_groups():
    assert ALL_KINDS == tuple(k.name for k in TARGET_KINDS)
    assert set(DENSE_KINDS) | set(EXPERT_KINDS) | {LM_HEAD} == set(ALL_KINDS)
    assert all(k.startswith("experts.") for k in EXPERT_KINDS) and len(EXPERT_KINDS) == 3
    assert len({k.attr for k in TARGET_KINDS}) == len(TARGET_KINDS)


@pytest.mark.parametrize("path", [
    "layers.x.self_attn.q_proj", "layers.03.self_attn.q_proj", "layers.1.mlp.q_proj", "layers.1.self_attn.up_proj",
    "model.layers.1.self_attn.q_proj", "layers.1.mlp.gate", "layers.1.mlp.experts.0.up_proj", "embed_tokens", "",
])
def test_non_module_paths_are_refused(path):
    with pytest.raises(ValueError, match="not an adapter module path"):
        parse_module_path(path)


def test_unknown_kinds_and_tensor_names_are_refused():
    with pytest.raises(ValueError, match="unknown LoRA target kind"):
        tensor_names("qkv_proj", 0)
    with pytest.raises(ValueError, match="must end in"):
        parse_tensor_name("layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="unknown target kinds"):
        parse_targets("q_proj,qkv_proj")
    assert parse_targets(" q_proj, experts.up_proj ") == ["q_proj", "experts.up_proj"]


@pytest.mark.parametrize("kind", EXPERT_KINDS)
def test_expert_plane_paths_round_trip(kind):
    packed = module_path(kind, 4)
    plane = expert_plane_path(packed, 7)
    assert plane == f"layers.4.mlp.experts.7.{kind.removeprefix('experts.')}"
    assert parse_expert_plane_path(plane) == (packed, 7)


def test_expert_plane_path_of_other_modules():
    with pytest.raises(ValueError):
        expert_plane_path("layers.0.mlp.up_proj", 0)
    assert parse_expert_plane_path("layers.0.mlp.up_proj") is None
    assert parse_expert_plane_path("layers.0.self_attn.3.q_proj") is None


@pytest.mark.parametrize("name", SERVING_DTYPES)
def test_serving_dtypes_round_trip(name):
    d = serving_dtype(name)
    assert name_of_code(d.st_code) == name
    dt = torch_dtype(name)
    assert dt == getattr(torch, name) and dtype_name(dt) == name
    assert torch.empty(0, dtype=dt).element_size() == d.itemsize


def test_dtype_table_refuses_what_is_not_served():
    assert [d.name for d in DTYPES if d.serving] == list(SERVING_DTYPES) == ["float32", "bfloat16", "float16"]
    assert name_of_code("F64") == "float64" and name_of_code("I8") is None
    for bad in ("float64", "int8", "auto"):
        with pytest.raises(ValueError, match="unsupported serving dtype"):
            torch_dtype(bad)
    with pytest.raises(ValueError, match="unsupported serving dtype"):
        dtype_name(torch.int32)
