"""PEFT adapters on the tiny transformers bases, imported into a catalog: the outside reference
for served-adapter parity."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

DENSE_ADAPTERS = {  # adapter id -> LoraConfig kwargs
    "t/qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "t/all-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "t/o-head-r2": dict(r=2, lora_alpha=4, target_modules=["o_proj", "lm_head"]),
}
MOE_ADAPTERS = {
    "t/moe-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


@dataclass
class AdapterSet:
    base: Path
    catalog: Path
    peft_dirs: dict[str, Path]


def make_peft(base: Path, out: Path, seed: int, **lora_kw) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kw))
    with torch.no_grad():  # make the deltas large enough to move greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    return out


def build_set(root: Path, base: Path, adapters: dict[str, dict]) -> AdapterSet:
    from loraserve.catalog.importer import import_peft
    from loraserve.catalog.store import Catalog

    peft_dirs = {aid: make_peft(base, root / aid.replace("/", "_"), i, **kw)
                 for i, (aid, kw) in enumerate(adapters.items())}
    cat_dir = root / "catalog"
    with Catalog.create(cat_dir, shards=4) as cat:
        for aid, d in peft_dirs.items():
            import_peft(cat, aid, d, base, promote=True)
    return AdapterSet(base, cat_dir, peft_dirs)


@pytest.fixture(scope="session")
def dense_set(tmp_path_factory, hf_dense) -> AdapterSet:
    return build_set(tmp_path_factory.mktemp("dense_lora"), hf_dense, DENSE_ADAPTERS)


@pytest.fixture(scope="session")
def moe_set(tmp_path_factory, hf_moe) -> AdapterSet:
    return build_set(tmp_path_factory.mktemp("moe_lora"), hf_moe, MOE_ADAPTERS)
