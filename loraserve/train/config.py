"""What a training run trains: rank, alpha, seed and which target kinds (Tinker's LoraConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from loraserve.catalog.targets import DENSE_KINDS, LM_HEAD

ATTENTION_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_KINDS = tuple(k for k in DENSE_KINDS if k not in ATTENTION_KINDS)
DEFAULT_ALPHA = 32.0  # PEFT's scale alpha / rank; Tinker's LoraConfig names no alpha


class TrainingError(ValueError):
    """A request the trainer refuses (a 400 at the API): bad config, bad datum, diverged step."""


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

    def kinds(self, is_moe: bool) -> list[str]:
        """Target kinds in the catalog's canonical order. MoE experts have no trainer: a MoE base
        refuses train_mlp rather than silently training less than asked."""
        if is_moe and self.train_mlp:
            raise TrainingError("LoRA training of MoE experts is not supported; create the run with "
                                "train_mlp=False on a mixture-of-experts base")
        kinds = [*(ATTENTION_KINDS if self.train_attn else ()), *(MLP_KINDS if self.train_mlp else ())]
        return kinds + ([LM_HEAD] if self.train_unembed else [])
