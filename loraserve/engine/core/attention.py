"""Paged attention in plain torch: write this step's K/V into the block cache, gather each
sequence's context through its block table, attend with one padded SDPA call per layer.

The per-step metadata (slot mapping, gather index, mask) is built once and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from loraserve.kernels import cpu_fused
from loraserve.kernels.tracing import compiling


class KVCache:
    """k, v: [L, (num_blocks + 1) * block_size, Hkv, D] each (blocks flattened into token slots).

    The block after the `num_blocks` the caller hands out is the *null block*: zeros, never
    written. Every padded or masked context position reads it (`null_slot`), never a slot of a
    real block. A mask keeps such positions out of the softmax, but SDPA still multiplies their
    V by a zero weight, and 0 * Inf is NaN: had padding read a real block, a sequence that wrote
    Inf into its K/V (an adapter with huge factors) would turn its batch neighbours' outputs to
    NaN, and go on doing so from the cache after it ended. With the null block, a sequence reads
    only its own slots and zeros.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # one view per layer, made once: an eager step indexes a tuple, not the tensor (a
        # dispatch, 4 a layer), for its writes and gathers
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads  # a plain int: static even where cache dims are symbolic
        self.null_block = num_blocks
        self.null_slot = num_blocks * block_size

    def scrub(self, blocks: list[int]) -> None:
        """Zero `blocks` in every layer: a failed sequence's K/V never meet a later owner."""
        if not blocks:
            return
        bs = self.block_size
        slots = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten().to(self.k.device)
        self.k.index_fill_(1, slots, 0)
        self.v.index_fill_(1, slots, 0)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass(slots=True)
class PagedAttention:
    """The AttentionFn the model calls: attn(layer, q, k, v) -> out.

    Tokens of the step are flattened: N = sum of new tokens over B sequences. Gathers use
    `index_select` on flat indices (several times faster on CPU than 2-D advanced indexing), GQA
    goes to SDPA as is on CPU (`enable_gqa`: no repeated K/V copies), and a decode step (one query
    per sequence, the common case) views q and the output in place.
    """

    cache: KVCache
    slot_mapping: torch.Tensor   # [N] int64: cache slot each new token's K/V goes to
    q_index: torch.Tensor        # [B * Q] int64: flattened token row of each padded query (pads -> 0)
    q_valid_pos: torch.Tensor    # [N] int64: position in the [B * Q] padded queries of token row n
    kv_index: torch.Tensor       # [B * C] int64: cache slot of each context position (pads -> null)
    mask: torch.Tensor           # [B, 1, Q, C] bool: True = may attend
    shape: tuple[int, int, int]  # B, Q, C
    single_query: bool           # Q == 1: every sequence brings one token (decode)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, on first use
    full: bool = False           # the mask is all True (decode, no sequence shorter than C): SDPA takes none
    kv_run: tuple[int, int] | None = None  # one sequence whose context is cache slots [lo, hi): read as a view
    lens: torch.Tensor | None = None  # [B] int64: context length of each sequence (its end), for the fused decode op

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None) -> torch.Tensor:
        # q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]; with `window`, only the last `window` positions
        cache = self.cache
        # a compiled graph reads no per-step Python field (`full`, `kv_run`): each is a guard,
        # and a real step that differs from the warm-up's would recompile while serving
        traced = compiling()
        if k.dtype == q.dtype and self._decodes_fused(q):
            # eager decode on the CPU: the cache write, each sequence's own context read through
            # kv_index, GQA and the softmax in one op (cpu_fused), not ~14 dispatches a layer
            return cpu_fused.decode_attention(q, k, v, cache.k_layers[layer], cache.v_layers[layer],
                                              self.slot_mapping, self.kv_index, self.lens, window or 0,
                                              q.shape[-1] ** -0.5)
        if traced:
            # the write as an index_put_ on the whole cache (layer and slot indices): inductor
            # scatters the rows in place inside a fused kernel. Written through a layer view
            # (`cache.k[layer]`) it would be a functional update of a graph input, which copies
            # the whole cache every step (3.5x slower than eager, measured on the CPU)
            layers = torch.full_like(self.slot_mapping, layer)
            cache.k.index_put_((layers, self.slot_mapping), _as(k, cache.k.dtype))
            cache.v.index_put_((layers, self.slot_mapping), _as(v, cache.v.dtype))
            kc, vc = cache.k[layer], cache.v[layer]
        else:
            kc, vc = cache.k_layers[layer], cache.v_layers[layer]
            kc.index_copy_(0, self.slot_mapping, _as(k, kc.dtype))
            vc.index_copy_(0, self.slot_mapping, _as(v, vc.dtype))
        b, _, nq, c = self.mask.shape  # from a tensor, not `shape`: symbolic under torch.compile
        heads, d = q.shape[1], q.shape[2]
        if not traced and self.kv_run is not None:
            # one sequence in consecutive blocks (`BlockManager` hands out the lowest free ones):
            # its context is a slice of the cache, no gather (a copy of every context row)
            kc, vc = kc[self.kv_run[0]:self.kv_run[1]], vc[self.kv_run[0]:self.kv_run[1]]
        else:
            kc, vc = kc.index_select(0, self.kv_index), vc.index_select(0, self.kv_index)
        kb = kc.view(b, c, -1, d).transpose(1, 2)                                      # [B, Hkv, C, D]
        vb = vc.view(b, c, -1, d).transpose(1, 2)
        qs = q if self.single_query else q.index_select(0, self.q_index)
        qb = qs.view(b, nq, heads, d).transpose(1, 2)                                # [B, Hq, Q, D]
        rep = heads // self.cache.num_kv_heads
        if rep > 1 and q.device.type != "cpu":
            # CUDA: a boolean mask rules out flash attention, and the memory-efficient kernel
            # does not take GQA, so repeat K/V rather than fall back to the math kernel
            kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
        if window is not None:
            mask = self.window_mask(window)
        else:  # a mask of all True is none: SDPA skips building an additive mask from it
            mask = None if not traced and self.full else self.mask
        if traced and self.single_query and q.device.type == "cpu":
            out = _decode_attention(qb, kb, vb, mask)
        else:
            out = F.scaled_dot_product_attention(qb, _as(kb, qb.dtype), _as(vb, qb.dtype), attn_mask=mask,
                                                 enable_gqa=heads != self.cache.num_kv_heads)
        out = out.transpose(1, 2).reshape(b * nq, heads, d)                          # [B * Q, Hq, D]
        return out if self.single_query else out.index_select(0, self.q_valid_pos)

    def fused_qkv(self, layer: int, qkv: torch.Tensor, heads: int, kv_heads: int, rope: tuple[torch.Tensor, torch.Tensor],
                  norm_w: torch.Tensor | None, eps: float, window: int | None) -> torch.Tensor | None:
        """The model's optional fast path (`model.layers.AttentionFn.fused_qkv`): q/k norm, rotary
        and attention straight from a fused q/k/v output [N, (Hq + 2 Hkv) D] -> [N, Hq D], in one op
        (cpu_fused.qkv_attention) where `__call__` would take the fused decode op; None elsewhere
        (the model then slices q, k and v and calls this object as usual)."""
        attend = self._decoder(qkv, rope) if norm_w is None or norm_w.dtype == qkv.dtype else None
        return None if attend is None else attend(layer, qkv, heads, kv_heads, norm_w, eps, window or 0)

    def qkv_decoder(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> Callable | None:
        """`fused_qkv` for every layer of this step, checked once (`model.decode_plan`): a function
        (layer, qkv, heads, kv_heads, norm_w, eps, window) -> [T, Hq * D] with the step's cache,
        slots and rotary bound, or None where `fused_qkv` would decline x (norm_w the caller's to
        match x's dtype)."""
        return self._decoder(x, rope)

    def _decoder(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> Callable | None:
        """`qkv_decoder`'s closure (`fused_qkv` makes its one call through it too)."""
        if not (rope[0].dtype == x.dtype and self._decodes_fused(x)):
            return None
        cache, (cos, sin) = self.cache, rope
        k_layers, v_layers, scale = cache.k_layers, cache.v_layers, cache.k.shape[-1] ** -0.5
        slots, kv_index, lens = self.slot_mapping, self.kv_index, self.lens

        def attend(layer: int, qkv: torch.Tensor, heads: int, kv_heads: int, norm_w: torch.Tensor | None, eps: float,
                   window: int) -> torch.Tensor:
            return cpu_fused.qkv_attention(qkv, heads, kv_heads, cos, sin, norm_w, eps, k_layers[layer],
                                           v_layers[layer], slots, kv_index, lens, window, scale)
        # the same arguments for a loop over every layer in C++ (`cpu_fused.decode_layers`)
        attend.step_args = (k_layers, v_layers, cos, sin, slots, kv_index, lens, scale)
        return attend

    def _decodes_fused(self, x: torch.Tensor) -> bool:
        """Whether this step's attention on `x` (q or the fused q/k/v output) takes the fused
        decode op: one query per sequence, lengths known, x in the cache's dtype, and
        `cpu_fused.usable` (CPU, serving, eager)."""
        return self.single_query and self.lens is not None and x.dtype == self.cache.k.dtype and cpu_fused.usable(x)

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` without keys `window` or more positions behind their query (sliding-window
        layers), built once per step and window. A query's position is its count of visible keys - 1."""
        if window not in self.window_masks:
            qpos = self.mask.sum(-1, keepdim=True) - 1                                 # [B, 1, Q, 1]
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.window_masks[window] = self.mask & (pos > qpos - window)
        return self.window_masks[window]

    @classmethod
    def build(cls, cache: KVCache, block_tables: list[list[int]], starts: list[int],
              ends: list[int], device: torch.device, context: int | None = None) -> PagedAttention:
        """Sequence b contributes tokens at positions starts[b]..ends[b]-1 this step and attends
        to positions 0..ends[b]-1 of its own context. Vectorised: no per-token Python work.
        `context` pads the context axis C to a fixed width (>= every end; a compiled decode
        step's bucket), else C is the longest context of the step. A decode step (one token a
        sequence) takes `_build_decode`: the same tensors from a third of the ops."""
        if all(e - s == 1 for s, e in zip(starts, ends)) and starts:
            return cls._build_decode(cache, block_tables, ends, device, context)
        return cls._build_general(cache, block_tables, starts, ends, device, context)

    @classmethod
    def _build_decode(cls, cache: KVCache, block_tables: list[list[int]], ends: list[int],
                      device: torch.device, context: int | None = None) -> PagedAttention:
        """`build` where sequence b adds the one token at position ends[b] - 1 (Q = 1): its
        query row is b, its slot is read from its block table in Python, and its mask row is
        the positions before its end. ~12 ops where the general form takes ~35, each a few µs:
        ~0.2 ms of a one-stream SmolLM2 step (bench/RESULTS.md, session 20)."""
        bs = cache.block_size
        C, padded = _context_tables(cache, block_tables, max(ends), context)
        tables = torch.tensor(padded)                                                 # [B, blocks]
        pos = torch.arange(C)
        end_t = torch.tensor(ends)
        live = pos[None, :] < end_t[:, None]                                         # [B, C]
        kv_index = (tables[:, pos // bs] * bs + pos % bs).masked_fill_(~live, cache.null_slot)
        slot_mapping = torch.tensor([t[(e - 1) // bs] * bs + (e - 1) % bs for t, e in zip(padded, ends)])
        rows = torch.arange(len(ends))
        to = lambda x: x.to(device, non_blocking=True)
        return cls(cache, to(slot_mapping), to(rows), to(rows), to(kv_index.flatten()),
                   to(live[:, None, None, :]), (len(ends), 1, C), True, full=min(ends) == C,
                   kv_run=_one_run(block_tables, ends, C, bs), lens=to(end_t))

    @classmethod
    def _build_general(cls, cache: KVCache, block_tables: list[list[int]], starts: list[int],
                       ends: list[int], device: torch.device, context: int | None = None) -> PagedAttention:
        """`build` for any step (prefill chunks of any length, decode tokens)."""
        bs = cache.block_size
        start_t, end_t = torch.tensor(starts), torch.tensor(ends)
        q_len = end_t - start_t
        Q = int(q_len.max())
        C, padded = _context_tables(cache, block_tables, max(ends), context)
        tables = torch.tensor(padded)                                                 # [B, blocks]
        pos = torch.arange(C)
        kv_index = tables[:, pos // bs] * bs + pos % bs                               # [B, C]
        # positions past a sequence's end read the null block (zeros), never a real block
        kv_index = kv_index.masked_fill(pos[None, :] >= end_t[:, None], cache.null_slot)
        qi = torch.arange(Q)
        q_valid = qi[None, :] < q_len[:, None]                                        # [B, Q]
        row0 = torch.cumsum(q_len, 0) - q_len
        q_index = torch.where(q_valid, row0[:, None] + qi[None, :], 0)
        qpos = torch.where(q_valid, start_t[:, None] + qi[None, :], 0)                # [B, Q]
        slot_mapping = kv_index.gather(1, qpos)[q_valid]                              # [N]
        mask = pos[None, None, :] <= qpos[:, :, None]                                 # [B, Q, C]
        valid_pos = q_valid.flatten().nonzero().squeeze(1)  # token rows are in (b, i) order
        to = lambda x: x.to(device, non_blocking=True)
        return cls(cache, to(slot_mapping), to(q_index.flatten()), to(valid_pos), to(kv_index.flatten()),
                   to(mask[:, None]), (len(starts), Q, C), Q == 1, full=Q == 1 and min(ends) == C,
                   kv_run=_one_run(block_tables, ends, C, bs), lens=to(end_t))


def _context_tables(cache: KVCache, block_tables: list[list[int]], longest: int,
                    context: int | None) -> tuple[int, list[list[int]]]:
    """The step's context width C (`context`, which must hold the longest, else the longest) and
    its block tables padded with the null block to one width that covers C."""
    if context is not None and context < longest:
        raise ValueError(f"context {context} is shorter than the step's longest ({longest})")
    c = longest if context is None else context
    width = max(max(len(t) for t in block_tables), -(-c // cache.block_size))
    return c, [t + [cache.null_block] * (width - len(t)) for t in block_tables]


def _one_run(block_tables: list[list[int]], ends: list[int], context: int, bs: int) -> tuple[int, int] | None:
    """Slots [lo, lo + context) when one sequence attends to exactly its `context` positions and
    they lie in consecutive blocks, else None (several sequences, padding, or scattered blocks)."""
    if len(block_tables) != 1 or ends[0] != context:
        return None
    used = block_tables[0][:-(-context // bs)]
    if any(b != used[0] + i for i, b in enumerate(used)):
        return None
    return used[0] * bs, used[0] * bs + context


def _decode_attention(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of one query per sequence as plain ops, for a compiled CPU step: inductor fuses the
    K/V gather, the mask and the softmax into its own kernels around two small batched GEMMs
    (~45 µs a layer at 0.6B shapes, against ~110 µs for the SDPA kernel it would call).
    qb [B, Hq, 1, D], kb/vb [B, Hkv, C, D], mask [B, 1, 1, C] -> [B, Hq, 1, D]. GQA as SDPA's
    `enable_gqa`: query head h reads K/V head h // (Hq / Hkv). Summed in float32; a masked
    position weighs exactly 0, and every query sees at least its own position."""
    b, heads, _, d = qb.shape
    kv_heads, c = kb.shape[1], kb.shape[2]
    qg = qb.reshape(b, kv_heads, heads // kv_heads, d).float()
    scores = torch.matmul(qg, kb.float().transpose(-1, -2)) * d ** -0.5           # [B, Hkv, rep, C]
    scores = scores.masked_fill(~mask.view(b, 1, 1, c), float("-inf"))
    out = torch.matmul(scores.softmax(-1), vb.float())                            # [B, Hkv, rep, D]
    return out.reshape(b, heads, 1, d).to(qb.dtype)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; x itself when it already is (no dispatch: a step calls this 112 times)."""
    return x if x.dtype == dtype else x.to(dtype)
