"""What a training run trains: rank, alpha, seed and which target kinds (Tinker's LoraConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from loraserve.catalog.targets import DENSE_KINDS, EXPERT_KINDS, LM_HEAD

ATTENTION_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_KINDS = tuple(k for k in DENSE_KINDS if k not in ATTENTION_KINDS)
DEFAULT_ALPHA = 32.0  # PEFT's scale alpha / rank; Tinker's LoraConfig names no alpha


class TrainingError(ValueError):
    """A request the trainer refuses (a 400 at the API): bad config, bad datum, diverged step.
    `param`: the field it names, when one (an Adam parameter)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Tinker's `LoraConfig` plus alpha. Targets every layer's modules of the chosen groups."""

    rank: int = 8
    alpha: float = DEFAULT_ALPHA
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0:
            raise TrainingError(f"rank must be >= 1 and alpha > 0, got rank {self.rank}, alpha {self.alpha}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise TrainingError("nothing to train: train_attn, train_mlp and train_unembed are all false")

    @property
    def scale(self) -> float:
        """PEFT's LoRA scale, alpha / rank (folded into B when saved for serving)."""
        return self.alpha / self.rank

    def kinds(self, dense_mlp: bool = True, experts: bool = False) -> list[str]:
        """Target kinds in the catalog's canonical order. train_mlp trains every MLP the base has:
        its dense MLPs (`dense_mlp`) and its routed experts (`experts`: every expert's gate, up
        and down projections, a LoRA pair per expert)."""
        mlp = [*(MLP_KINDS if dense_mlp else ()), *(EXPERT_KINDS if experts else ())] if self.train_mlp else []
        return [*(ATTENTION_KINDS if self.train_attn else ()), *mlp] + ([LM_HEAD] if self.train_unembed else [])
