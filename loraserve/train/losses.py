"""The Tinker SDK's built-in losses, per datum, exactly as its docs define them.

Every tensor is per target position [N] (position i of the input predicts target_tokens[i]);
`target_logprobs` are the learner's, `logprobs` the sampler's. Each loss returns the elementwise
loss [N]; a datum's loss is its sum and a batch's loss the sum over datums (Tinker sums, it never
averages: `weights` / `advantages` carry any normalisation the caller wants).

    cross_entropy        -target_logprobs * weights
    importance_sampling  -exp(target_logprobs - logprobs) * advantages
    ppo                  -min(r * A, clamp(r, clip_low, clip_high) * A),  r = exp(target - logprobs)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from loraserve.train.config import TrainingError

PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # Tinker's defaults


def cross_entropy(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    return -target_logprobs * inputs["weights"]


def importance_sampling(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


class LossSpec:
    """One loss: its function, the float inputs a datum must carry besides target_tokens, its
    config keys with their defaults."""

    def __init__(self, fn: LossFn, inputs: tuple[str, ...], defaults: Mapping[str, float] | None = None):
        self.fn, self.inputs, self.defaults = fn, inputs, dict(defaults or {})

    def config(self, name: str, given: Mapping[str, float] | None) -> dict[str, float]:
        """The loss's config: defaults overridden by `given`; TrainingError for an unknown key."""
        unknown = sorted(set(given or {}) - set(self.defaults))
        if unknown:
            raise TrainingError(f"loss_fn_config keys {unknown} are not parameters of {name!r} "
                                f"(it takes {sorted(self.defaults) or 'none'})")
        return {**self.defaults, **{k: float(v) for k, v in (given or {}).items()}}


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",)),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages")),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), PPO_CLIP),
}


def loss_spec(name: str) -> LossSpec:
    """The spec of loss `name`; TrainingError naming the supported ones otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise TrainingError(f"loss_fn {name!r} is not supported here; supported: {', '.join(LOSSES)}") from None
