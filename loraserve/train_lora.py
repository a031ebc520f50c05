"""Train a tiny LoRA on our own model and save it exactly as PEFT does (demo adapters).

Training only: `TrainableLoRALinear` wraps an `nn.Linear` target with y = W x + s * B(A x),
s = alpha / r, A kaiming-uniform and B zero at start (PEFT's default init, `train.factors.peft_init`).
The serving path never uses this module; it serves the saved adapter through the catalog and the
SGMV kernels. (Runs on a served base train through `loraserve.train` instead: hooks on the
resident model, no module replaced.)
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from loraserve.catalog.targets import DENSE_KINDS, parse_module_path
from loraserve.model import CausalLM
from loraserve.train.factors import peft_init

DENSE_TARGETS = DENSE_KINDS  # the kinds this trainer wraps: every nn.Linear target of a decoder layer
PEFT_PREFIX = "base_model.model."


@dataclass(slots=True)
class LoRATrainConfig:
    """What to train: rank, alpha, target module kinds, steps and Adam learning rate."""

    r: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = DENSE_TARGETS
    steps: int = 300
    lr: float = 1e-2
    seed: int = 0
    target_loss: float = 1e-3     # stop early once the mean token loss is below this

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0 or self.steps <= 0 or self.lr <= 0:
            raise ValueError("r, alpha, steps and lr must all be > 0")
        unknown = set(self.targets) - set(DENSE_TARGETS)
        if not self.targets or unknown:
            raise ValueError(f"targets must be a non-empty subset of {DENSE_TARGETS}, got {self.targets}")


class TrainableLoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * lora_B(lora_A(x)); the base stays frozen."""

    def __init__(self, base: nn.Linear, r: int, alpha: int, gen: torch.Generator):
        super().__init__()
        self.base = base
        self.scale = alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False)   # weight [r, in]
        self.lora_B = nn.Linear(r, base.out_features, bias=False)  # weight [out, r]
        a, b = peft_init(r, base.in_features, base.out_features, gen)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def _kind_of(module_name: str) -> str | None:
    """The target kind of a named module of the model (`model.layers.0.mlp.up_proj` -> `up_proj`), or None."""
    try:
        return parse_module_path(module_name.removeprefix("model."))[0]
    except ValueError:
        return None


def attach_lora(model: CausalLM, cfg: LoRATrainConfig) -> dict[str, TrainableLoRALinear]:
    """Replace every targeted nn.Linear of `model` in place; returns {module path: wrapper}."""
    gen = torch.Generator().manual_seed(cfg.seed)
    wrapped: dict[str, TrainableLoRALinear] = {}
    for name, module in list(model.named_modules()):
        if _kind_of(name) in cfg.targets and isinstance(module, nn.Linear):
            lora = TrainableLoRALinear(module, cfg.r, cfg.alpha, gen)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, lora)
            wrapped[name] = lora
    if not wrapped:
        raise ValueError(f"no nn.Linear modules named {cfg.targets} in the model")
    return wrapped


def detach_lora(model: CausalLM, wrapped: dict[str, TrainableLoRALinear]) -> None:
    """Put the original nn.Linear modules back."""
    for name, lora in wrapped.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, lora.base)


def train_on_sequence(model: CausalLM, wrapped: dict[str, TrainableLoRALinear],
                      prompt_ids: list[int], target_ids: list[int], cfg: LoRATrainConfig) -> float:
    """Adam on the LoRA weights so the model continues `prompt_ids` with `target_ids`.

    The loss is next-token cross-entropy over the target tokens only; returns the last loss."""
    params = [p for lora in wrapped.values() for p in (lora.lora_A.weight, lora.lora_B.weight)]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    ids = torch.tensor(prompt_ids + target_ids, dtype=torch.long)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    try:
        with one_thread():
            loss = _adam_steps(model, opt, ids, len(prompt_ids), cfg)
    finally:
        for p in params:
            p.requires_grad_(False)
    return loss


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread: for tiny matmuls that is several times faster than two
    threads, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _adam_steps(model: CausalLM, opt: torch.optim.Optimizer, ids: Tensor, n_prompt: int,
                cfg: LoRATrainConfig) -> float:
    positions = torch.arange(len(ids))
    labels = ids[n_prompt:]                                            # [T_target]
    loss_value = float("inf")
    for _ in range(cfg.steps):
        hidden = model(ids, positions)[n_prompt - 1:-1]               # predicts each target token
        loss = F.cross_entropy(model.compute_logits(hidden), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        if loss_value < cfg.target_loss:
            break
    return loss_value


def save_peft_adapter(wrapped: dict[str, TrainableLoRALinear], out_dir: str | Path,
                      cfg: LoRATrainConfig, base_model_name_or_path: str) -> None:
    """Write adapter_model.safetensors and adapter_config.json as PEFT's save_pretrained does.

    adapter_config.json is written last, so its presence marks a complete adapter directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, lora in wrapped.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = lora.lora_A.weight.detach().contiguous().clone()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = lora.lora_B.weight.detach().contiguous().clone()
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.r, "lora_alpha": cfg.alpha,
        "target_modules": sorted({n.rpartition(".")[2] for n in wrapped}), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "revision": None, "base_model_name_or_path": base_model_name_or_path,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
