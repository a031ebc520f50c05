"""Paged attention in plain torch: write this step's K/V into the block cache, gather each
sequence's context through its block table, attend with one padded SDPA call per layer.

The per-step metadata (slot mapping, gather index, mask) is built once and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """k, v: [L, num_blocks * block_size, Hkv, D] each (blocks flattened into token slots)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass(slots=True)
class PagedAttention:
    """The AttentionFn the model calls: attn(layer, q, k, v) -> out.

    Tokens of the step are flattened: N = sum of new tokens over B sequences.
    """

    cache: KVCache
    slot_mapping: torch.Tensor   # [N] int64: cache slot each new token's K/V goes to
    q_index: torch.Tensor        # [B, Q] int64: flattened token row of each padded query (pads -> 0)
    q_valid: torch.Tensor        # [B, Q] bool
    kv_index: torch.Tensor       # [B, C] int64: cache slot of each context position (pads -> 0)
    mask: torch.Tensor           # [B, 1, Q, C] bool: True = may attend

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.index_copy_(0, self.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, self.slot_mapping, v.to(vc.dtype))
        qb = q[self.q_index].transpose(1, 2)                  # [B, Hq, Q, D]
        kb = kc[self.kv_index].transpose(1, 2)                # [B, Hkv, C, D]
        vb = vc[self.kv_index].transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            kb = kb.repeat_interleave(rep, dim=1)
            vb = vb.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qb, kb.to(qb.dtype), vb.to(qb.dtype), attn_mask=self.mask)
        out = out.transpose(1, 2)                             # [B, Q, Hq, D]
        flat = torch.empty_like(q)
        flat[self.q_index[self.q_valid]] = out[self.q_valid]
        return flat

    @classmethod
    def build(cls, cache: KVCache, block_tables: list[list[int]], starts: list[int],
              ends: list[int], device: torch.device) -> PagedAttention:
        """Sequence b contributes tokens at positions starts[b]..ends[b]-1 this step and attends
        to positions 0..ends[b]-1 of its own context."""
        bs = cache.block_size
        q_lens = [e - s for s, e in zip(starts, ends)]
        B, Q, C = len(ends), max(q_lens), max(ends)
        slot_mapping, q_index, q_valid, kv_index, qpos = [], [], [], [], []
        row = 0
        for table, s, e, n in zip(block_tables, starts, ends, q_lens):
            slots = [table[p // bs] * bs + p % bs for p in range(e)]
            slot_mapping.extend(slots[s:e])
            q_index.append(list(range(row, row + n)) + [0] * (Q - n))
            q_valid.append([True] * n + [False] * (Q - n))
            qpos.append(list(range(s, e)) + [0] * (Q - n))
            kv_index.append(slots + [0] * (C - e))
            row += n
        qpos_t = torch.tensor(qpos)
        mask = torch.arange(C)[None, None, :] <= qpos_t[:, :, None]          # [B, Q, C]
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)
        return cls(cache, t(slot_mapping), t(q_index), t(q_valid, torch.bool), t(kv_index),
                   mask[:, None].to(device))
