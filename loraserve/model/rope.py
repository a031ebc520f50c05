"""Rotary position embedding: inverse frequencies (plain, or Llama 3.1's scaled ones) and rotation.

Standard non-interleaved (rotate-half) RoPE with inverse frequencies theta^(-2i/D), as
transformers' default and `llama3` rope types compute them. Letters: T tokens, D head dim.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from loraserve.model.arch import RopeScaling

Device = torch.device | str | None


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """[D/2] float32 on CPU: theta^(-2i/D), then Llama 3.1's scaling when given (see RopeScaling)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """positions -> (cos, sin) tables for `apply_rotary`."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 device: Device = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)  # [D/2] fp32

    def _inv_freq(self, device: Device) -> Tensor:
        # computed on CPU: meta-device arange is slow on first use and the values are tiny
        return inv_frequencies(self.head_dim, self.theta, self.scaling).to(device)

    def reset_buffers(self, device: Device) -> None:
        """Recompute inv_freq on `device` (after building the model on the meta device)."""
        self.inv_freq = self._inv_freq(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] -> (cos, signed sin), each [T, 1, D] in `dtype`, broadcastable over heads,
        for `apply_rotary`: cos of both halves, and sin with the first half negated."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]        # [T, D/2]
        emb = torch.cat((-freqs, freqs), dim=-1)[:, None, :]               # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)                  # cos(-f) = cos(f)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, D] rotated: x*cos + rotate_half(x)*sin, where rotate_half(x) = (-x2, x1) is
    roll(x) = (x2, x1) times the sign `RotaryEmbedding` folded into its sin table: three kernels
    (roll, mul, addcmul) where negating and concatenating the halves took five, 56 times a step."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)
