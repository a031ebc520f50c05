"""PEFT -> serving layout: equals PEFT's merged weights; MoE packing; bad input names the tensor."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.catalog.base import BaseInfo, base_fingerprint
from loraserve.catalog.errors import BaseMismatch, ExportError
from loraserve.catalog.export import export_peft
from loraserve.catalog.importer import adapter_blob, import_peft
from loraserve.catalog.layout import load_revision, save_revision
from loraserve.catalog.store import Catalog
from catalog_fixtures import DENSE_TARGETS, make_peft

ATOL = 1e-5


def merged_deltas(peft_model) -> dict[str, torch.Tensor]:
    """HF name -> (merged - base) weight, as PEFT itself merges."""
    base = {k: v.detach().clone() for k, v in peft_model.get_base_model().state_dict().items() if "lora_" not in k}
    base = {k.replace(".base_layer", ""): v for k, v in base.items()}
    merged = peft_model.merge_and_unload().state_dict()
    return {k: merged[k] - base[k] for k in merged if k in base}


def blob_delta(w, path: str) -> torch.Tensor:
    return w.tensors[f"{path}.lora_B"].float() @ w.tensors[f"{path}.lora_A"].float()


@pytest.mark.parametrize("rslora", [False, True])
def test_dense_export_import_load_equals_peft_merge(dense_base, tmp_path, rslora):
    peft_dir, model = make_peft(dense_base, tmp_path / "peft", "qwen3", r=4, lora_alpha=8, use_rslora=rslora,
                                target_modules=DENSE_TARGETS, rank_pattern={"q_proj": 2})
    deltas = merged_deltas(model)
    base = BaseInfo.from_dir(dense_base)
    with Catalog.create(tmp_path / "cat", shards=3) as cat:
        rec = import_peft(cat, "acme/dense", peft_dir, dense_base)
        w = load_revision(cat.read_blob(rec))
    assert rec.base_fingerprint == base.fingerprint == w.base_fingerprint
    assert w.rank == 4 and w.targets == DENSE_TARGETS
    assert w.tensors["layers.0.self_attn.q_proj.lora_A"][2:].abs().max() == 0  # rank 2 padded to 4
    for layer in range(2):
        for kind in DENSE_TARGETS[:-1]:
            block = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            path = f"layers.{layer}.{block}.{kind}"
            torch.testing.assert_close(blob_delta(w, path), deltas[f"model.{path}.weight"], atol=ATOL, rtol=0)
    torch.testing.assert_close(blob_delta(w, "lm_head"), deltas["lm_head.weight"], atol=ATOL, rtol=0)


def test_moe_target_parameters_equal_peft_merge(moe_base, tmp_path):
    peft_dir, model = make_peft(moe_base, tmp_path / "peft", "qwen3_moe", r=3, lora_alpha=6,
                                target_modules=["q_proj", "v_proj"],
                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    deltas = merged_deltas(model)
    w = export_peft(peft_dir, BaseInfo.from_dir(moe_base))
    assert w.targets == ["q_proj", "v_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj"]
    a = w.tensors["layers.1.mlp.experts.gate_proj.lora_A"]
    assert a.shape == (4, 3, 32) and w.tensors["layers.1.mlp.experts.down_proj.lora_B"].shape == (4, 32, 3)
    for layer in range(2):
        gate_up = deltas[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
        i = gate_up.shape[1] // 2
        p = f"layers.{layer}.mlp.experts"
        torch.testing.assert_close(blob_delta(w, f"{p}.gate_proj"), gate_up[:, :i], atol=ATOL, rtol=0)
        torch.testing.assert_close(blob_delta(w, f"{p}.up_proj"), gate_up[:, i:], atol=ATOL, rtol=0)
        torch.testing.assert_close(blob_delta(w, f"{p}.down_proj"), deltas[f"model.{p}.down_proj"], atol=ATOL, rtol=0)
        q = f"layers.{layer}.self_attn.q_proj"
        torch.testing.assert_close(blob_delta(w, q), deltas[f"model.{q}.weight"], atol=ATOL, rtol=0)


def _write_per_expert_peft(fused_dir, out_dir, experts: int, rank: int) -> None:
    """Rewrite a fused `target_parameters` adapter in the per-expert PEFT form (older transformers)."""
    src = load_file(str(fused_dir / "adapter_model.safetensors"))
    out = {}
    for name, t in src.items():
        if ".mlp.experts." not in name:
            out[name] = t
            continue
        layer_prefix = name.split(".mlp.experts.")[0]
        factor = "A" if ".lora_A." in name else "B"
        is_gate_up = ".base_layer." in name  # PEFT nests the first target parameter innermost
        for e in range(experts):
            if factor == "A":
                a = t.reshape(experts, rank, -1)[e]
                parts = {"gate_proj": a, "up_proj": a} if is_gate_up else {"down_proj": a}
            else:
                b = t.reshape(t.shape[0], rank, experts)[:, :, e]
                half = b.shape[0] // 2
                parts = {"gate_proj": b[:half], "up_proj": b[half:]} if is_gate_up else {"down_proj": b}
            for proj, v in parts.items():
                out[f"{layer_prefix}.mlp.experts.{e}.{proj}.lora_{factor}.weight"] = v.clone()
    out_dir.mkdir()
    save_file(out, str(out_dir / "adapter_model.safetensors"))
    cfg = json.loads((fused_dir / "adapter_config.json").read_text())
    cfg["target_parameters"] = None
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg))


def test_moe_packing_equals_per_expert_form(moe_base, tmp_path):
    fused_dir, _ = make_peft(moe_base, tmp_path / "fused", "qwen3_moe", r=2, lora_alpha=4,
                             target_modules=["q_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    _write_per_expert_peft(fused_dir, tmp_path / "per_expert", experts=4, rank=2)
    base = BaseInfo.from_dir(moe_base)
    fused, per_expert = export_peft(fused_dir, base), export_peft(tmp_path / "per_expert", base)
    assert fused.tensors.keys() == per_expert.tensors.keys()
    for name in fused.tensors:
        torch.testing.assert_close(fused.tensors[name], per_expert.tensors[name], atol=0, rtol=0)
    assert load_revision(save_revision(fused)).tensors.keys() == fused.tensors.keys()


def test_export_casts_to_serving_dtype(dense_base, tmp_path):
    peft_dir, _ = make_peft(dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=2, target_modules=["v_proj"])
    w = export_peft(peft_dir, BaseInfo.from_dir(dense_base), dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in w.tensors.values())


def test_other_base_is_refused_naming_the_tensor(dense_base, other_dense_base, tmp_path):
    peft_dir, _ = make_peft(other_dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=2, target_modules=["q_proj"])
    with pytest.raises(ExportError, match=r"layers\.0\.self_attn\.q_proj\.lora_A.*another base") as e:
        export_peft(peft_dir, BaseInfo.from_dir(dense_base))
    assert e.value.status == 400


def test_exported_blob_for_other_base_is_base_mismatch(dense_base, other_dense_base, tmp_path):
    peft_dir, _ = make_peft(other_dense_base, tmp_path / "peft", "qwen3", r=2, lora_alpha=2, target_modules=["q_proj"])
    other = BaseInfo.from_dir(other_dense_base)
    blob_file = tmp_path / "a.safetensors"
    blob_file.write_bytes(adapter_blob(peft_dir, other))
    base = BaseInfo.from_dir(dense_base)
    with pytest.raises(BaseMismatch) as e:
        adapter_blob(blob_file, base)
    assert other.fingerprint in str(e.value) and base.fingerprint in str(e.value) and e.value.status == 409


def _edit_peft(peft_dir, edit) -> None:
    path = peft_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file(edit(tensors), str(path))


def test_unknown_target_and_bad_shapes_name_the_tensor(dense_base, tmp_path):
    src, _ = make_peft(dense_base, tmp_path / "src", "qwen3", r=2, lora_alpha=2, target_modules=["q_proj"])
    base = BaseInfo.from_dir(dense_base)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    unknown = tmp_path / "unknown"
    shutil.copytree(src, unknown)
    _edit_peft(unknown, lambda t: {**t, "base_model.model.model.layers.0.mlp.router.lora_A.weight": t[key].clone(),
                                  "base_model.model.model.layers.0.mlp.router.lora_B.weight": t[key].t().contiguous()})
    with pytest.raises(ExportError, match=r"layers\.0\.mlp\.router\.lora_A.*unknown LoRA target"):
        export_peft(unknown, base)

    shapes = tmp_path / "shapes"
    shutil.copytree(src, shapes)
    _edit_peft(shapes, lambda t: {**t, key: torch.zeros(2, 31)})
    with pytest.raises(ExportError, match=r"q_proj\.lora_A\.weight: shape \[2, 31\]"):
        export_peft(shapes, base)

    missing_layer = tmp_path / "layer9"
    shutil.copytree(src, missing_layer)
    _edit_peft(missing_layer, lambda t: {k.replace("layers.1.", "layers.9."): v for k, v in t.items()})
    with pytest.raises(ExportError, match=r"layers\.9\.self_attn\.q_proj.*does not have"):
        export_peft(missing_layer, base)

    dora = tmp_path / "dora"
    shutil.copytree(src, dora)
    _edit_peft(dora, lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(32)})
    with pytest.raises(ExportError, match="lora_magnitude_vector"):
        export_peft(dora, base)


def test_pickle_only_and_missing_config(dense_base, tmp_path):
    base = BaseInfo.from_dir(dense_base)
    (tmp_path / "pkl").mkdir()
    (tmp_path / "pkl" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "peft_type": "LORA"}))
    (tmp_path / "pkl" / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ExportError, match="pickle"):
        export_peft(tmp_path / "pkl", base)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="adapter_config.json"):
        export_peft(tmp_path / "empty", base)


def test_fingerprint_sharded_equals_single_file_and_tracks_weights(dense_base, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_base, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert base_fingerprint(tmp_path / "sharded") == base_fingerprint(dense_base)
    assert BaseInfo.from_dir(tmp_path / "sharded").modules.keys() == BaseInfo.from_dir(dense_base).modules.keys()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    model.save_pretrained(tmp_path / "changed")
    assert base_fingerprint(tmp_path / "changed") != base_fingerprint(dense_base)
