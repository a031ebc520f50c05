"""Per-step LoRA metadata: tokens grouped by segment key, built on the device without host syncs.

A *segment* is a run of tokens that share one key: the adapter slot (dense targets) or the pair
(slot, expert) (MoE targets, where the "tokens" are (token, expert) pairs). Tokens whose slot is
`-1` (base model only) are sorted after every segment and belong to none, so kernels never touch
them. Unused segment entries carry `seg_slot = -1` and an empty range, so a kernel can launch a grid
over all `S_max` segments without knowing how many are live (no `.item()`, CUDA-graph friendly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NO_LORA_KEY = torch.iinfo(torch.int64).max


@dataclass(slots=True)
class LoRAMeta:
    """Tokens grouped by segment key, in preallocated buffers (`T_max` tokens, `S_max` segments).

    Segment `s` covers `token_ids[seg_start[s]:seg_start[s+1]]`, all with adapter slot `seg_slot[s]`
    and expert `seg_expert[s]` (0 for dense targets). Live segments come first and are sorted by
    (slot, expert); `seg_start[S_max]` is the number of LoRA tokens; base-only tokens follow them in
    `token_ids`.
    """

    token_ids: torch.Tensor  # [T_max] int32, token indices grouped by segment, base-only last
    sorted_slots: torch.Tensor  # [T_max] int32, slot of token_ids[i] (-1 = base only)
    sorted_experts: torch.Tensor  # [T_max] int32, expert of token_ids[i] (0 for dense)
    seg_start: torch.Tensor  # [S_max + 1] int32, segment s = token_ids[seg_start[s]:seg_start[s+1]]
    seg_slot: torch.Tensor  # [S_max] int32, adapter slot of segment s (-1 = unused)
    seg_expert: torch.Tensor  # [S_max] int32, expert of segment s (0 dense, -1 unused)
    num_segments: torch.Tensor  # [1] int32, live segments (device tensor, never synced here)
    num_tokens: int = 0  # T of the last build (<= T_max); the ops check x/y against it
    moe: bool = False  # built with token_experts: pools must be [P, E, H]

    def __post_init__(self) -> None:
        int_fields = ("token_ids", "sorted_slots", "sorted_experts", "seg_start", "seg_slot",
                      "seg_expert", "num_segments")
        device = self.token_ids.device
        for name in int_fields:
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"LoRAMeta.{name} must be a contiguous 1-D int32 tensor, "
                                 f"got {t.dtype} {tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"LoRAMeta.{name} is on {t.device}, token_ids on {device}")
        t_max, s_max = self.token_ids.numel(), self.seg_slot.numel()
        if s_max < 1:
            raise ValueError("LoRAMeta needs max_segments >= 1")
        for name in ("sorted_slots", "sorted_experts"):
            if getattr(self, name).numel() != t_max:
                raise ValueError(f"LoRAMeta.{name} must have T_max={t_max} entries")
        if self.seg_start.numel() != s_max + 1 or self.seg_expert.numel() != s_max:
            raise ValueError(f"LoRAMeta segment buffers disagree on S_max={s_max}")
        if self.num_segments.numel() != 1:
            raise ValueError("LoRAMeta.num_segments must have one element")
        if not 0 <= self.num_tokens <= t_max:
            raise ValueError(f"LoRAMeta.num_tokens={self.num_tokens} outside [0, {t_max}]")

    def tensors(self) -> list[torch.Tensor]:
        """The seven buffers in field order, so `LoRAMeta(*meta.tensors(), meta.num_tokens,
        meta.moe)` rebuilds the meta (how the custom ops in `ops.py` take it as arguments)."""
        return [self.token_ids, self.sorted_slots, self.sorted_experts, self.seg_start,
                self.seg_slot, self.seg_expert, self.num_segments]

    @property
    def max_tokens(self) -> int:
        """T_max: the token capacity of the buffers."""
        return self.token_ids.numel()

    @property
    def max_segments(self) -> int:
        """S_max: the segment capacity (the first grid axis of every kernel launch)."""
        return self.seg_slot.numel()

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @classmethod
    def empty(cls, max_tokens: int, max_segments: int, device: torch.device | str) -> LoRAMeta:
        """Preallocated buffers for `max_tokens` tokens and `max_segments` segments, empty."""
        if max_tokens < 0 or max_segments < 1:
            raise ValueError(f"need max_tokens >= 0 and max_segments >= 1, got "
                             f"{max_tokens}, {max_segments}")

        def buf(n: int, fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int32, device=device)

        return cls(buf(max_tokens, 0), buf(max_tokens, -1), buf(max_tokens, 0),
                   buf(max_segments + 1, 0), buf(max_segments, -1), buf(max_segments, -1),
                   buf(1, 0), 0, False)

    @classmethod
    def build(cls, token_slots: torch.Tensor, *, max_segments: int,
              token_experts: torch.Tensor | None = None, out: LoRAMeta | None = None) -> LoRAMeta:
        """Group tokens by (slot, expert), device-side only (sort, cumsum, scatter; no host sync).

        token_slots:   [T] int32, adapter slot per token (or per MoE pair); -1 = base only.
        token_experts: [T] int32, expert per MoE pair; None for dense targets (expert 0).
        max_segments:  S_max, an upper bound on the number of distinct (slot, expert) keys among
                       LoRA tokens: `A` slots for dense targets, `A * E` for MoE, and never more
                       than `T`, so `min(T_max, A)` / `min(T_max, A * E)` is always safe. Keys past
                       the bound would be merged into the last segment (wrong results); on CPU
                       this is checked and raises, on CUDA it is not (that would need a sync).
        out:           preallocated meta (see `LoRAMeta.empty`) written in place and returned.
        """
        _check_build_inputs(token_slots, token_experts, max_segments, out)
        t = token_slots.numel()
        if out is None:
            out = cls.empty(t, max_segments, token_slots.device)
        slots = token_slots.to(torch.int64)
        experts = (torch.zeros_like(slots) if token_experts is None
                   else token_experts.to(torch.int64))
        is_lora = slots >= 0
        key = torch.where(is_lora, (slots << 32) | experts, _NO_LORA_KEY)
        sorted_key, order = torch.sort(key, stable=True)
        lora_sorted = sorted_key != _NO_LORA_KEY
        # A segment starts wherever the key changes (and at the first token).
        starts = torch.ones_like(lora_sorted)
        starts[1:] = sorted_key[1:] != sorted_key[:-1]
        starts &= lora_sorted
        seg_id = torch.cumsum(starts, 0, dtype=torch.int32) - 1
        if out.device.type == "cpu" and t > 0 and int(seg_id[-1]) >= max_segments:
            raise ValueError(f"{int(seg_id[-1]) + 1} distinct (slot, expert) keys exceed "
                             f"max_segments={max_segments}")
        seg_id = seg_id.clamp_(0, max_segments - 1).long()
        _write(out, t, order, sorted_key, lora_sorted, seg_id, starts, token_experts is not None)
        return out

    @classmethod
    def from_host(cls, slots: list[int], *, max_segments: int, experts: list[int] | None = None,
                  device: torch.device | str = "cpu") -> LoRAMeta:
        """The same metadata as `build`, grouped in Python from host lists. For small CPU batches
        (a decode step), where a dozen tiny torch ops cost more than sorting a list: the engine
        already orders its batch by slot, so the sort is a linear pass. Not for CUDA steps, whose
        metadata `build` writes on the device into capture-stable buffers."""
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        t = len(slots)
        if experts is not None and len(experts) != t:
            raise ValueError("experts must have one entry per slot")
        ex = experts if experts is not None else [0] * t
        lora = sorted((i for i in range(t) if slots[i] >= 0), key=lambda i: (slots[i], ex[i]))
        seg_start, seg_slot, seg_expert, prev = [0], [], [], None
        for j, i in enumerate(lora):
            key = (slots[i], ex[i])
            if key != prev:
                if prev is not None:
                    seg_start.append(j)
                seg_slot.append(key[0])
                seg_expert.append(key[1])
                prev = key
        s = len(seg_slot)
        if s > max_segments:
            raise ValueError(f"{s} distinct (slot, expert) keys exceed max_segments={max_segments}")
        n, pad = len(lora), max_segments - s
        seg_start += [n] * (max_segments + 1 - len(seg_start))
        base = [i for i in range(t) if slots[i] < 0]

        fields = (lora + base, [slots[i] for i in lora] + [-1] * len(base),
                  [ex[i] for i in lora] + [0] * len(base), seg_start, seg_slot + [-1] * pad,
                  seg_expert + [-1] * pad, [s])
        # one host tensor, split into contiguous views: one allocation instead of seven
        flat = torch.tensor([v for f in fields for v in f], dtype=torch.int32, device=device)
        return cls(*flat.split([len(f) for f in fields]), t, experts is not None)


def _write(out: LoRAMeta, t: int, order: torch.Tensor, sorted_key: torch.Tensor,
           lora_sorted: torch.Tensor, seg_id: torch.Tensor, starts: torch.Tensor,
           moe: bool) -> None:
    """Fill `out`'s buffers from the sorted keys (all device ops, in place)."""
    slot_sorted = torch.where(lora_sorted, sorted_key >> 32, -1)
    expert_sorted = torch.where(lora_sorted, sorted_key & 0xFFFFFFFF, 0)
    out.token_ids[:t].copy_(order)
    out.sorted_slots[:t].copy_(slot_sorted)
    out.sorted_experts[:t].copy_(expert_sorted)
    counts = torch.zeros(out.max_segments, dtype=torch.int32, device=out.device)
    counts.scatter_add_(0, seg_id, lora_sorted.to(torch.int32))
    out.seg_start[0] = 0
    torch.cumsum(counts, 0, dtype=torch.int32, out=out.seg_start[1:])
    # Every LoRA token of a segment writes the same value; base-only tokens write -1, which the
    # max never picks over a real slot, so unused segments keep -1.
    out.seg_slot.fill_(-1)
    out.seg_slot.scatter_reduce_(0, seg_id, slot_sorted.to(torch.int32), "amax")
    out.seg_expert.fill_(-1)
    out.seg_expert.scatter_reduce_(0, seg_id, torch.where(lora_sorted, expert_sorted, -1)
                                   .to(torch.int32), "amax")
    out.num_segments.copy_(starts.sum(dtype=torch.int32).reshape(1))
    out.num_tokens = t
    out.moe = moe


def _check_build_inputs(token_slots: torch.Tensor, token_experts: torch.Tensor | None,
                        max_segments: int, out: LoRAMeta | None) -> None:
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be a 1-D int32 tensor, got "
                         f"{token_slots.dtype} {tuple(token_slots.shape)}")
    if token_experts is not None and (token_experts.shape != token_slots.shape
                                      or token_experts.dtype not in (torch.int32, torch.int64)
                                      or token_experts.device != token_slots.device):
        raise ValueError("token_experts must be an int32 tensor shaped and placed like token_slots")
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    if out is None:
        return
    if out.device != token_slots.device:
        raise ValueError(f"out meta is on {out.device}, token_slots on {token_slots.device}")
    if out.max_tokens < token_slots.numel() or out.max_segments != max_segments:
        raise ValueError(f"out meta holds T_max={out.max_tokens}, S_max={out.max_segments}; "
                         f"need T={token_slots.numel()}, S_max={max_segments}")
