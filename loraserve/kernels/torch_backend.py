"""The `torch` backend: vectorised LoRA ops for CPU (and, slower, any device). Same semantics as
the Triton kernels and `reference.py`.

A *plan* says how one call covers the step's LoRA tokens for one target kind, and runs itself:
`plan.run(y, x, A_rows, B_rows)`. Every layer of that kind reuses it (same metadata, row table,
ranks and widths), so `PlanCache` builds it once per step. The strategies:

- `_Padded` (small batches over at most 64 adapters, the common decode step): segments padded to
  the longest into `[S, L, H]` blocks, two `bmm` against each segment's rank rows. Each adapter's
  rows are read once; the engine groups its batch by adapter, so x, y and the pool rows are
  usually all views and a decode step is exactly two `bmm` with no copy.
- `_Gather` (*light* segments: one or a few tokens per adapter, and every MoE decode step): each
  token's rank rows gathered into `[n, r_b, H]` and one `bmm`; ~15 ops however many adapters.
  `r_b` is the largest rank among these tokens; rank indices past a token's own are masked.
- `_Segments` (*heavy* segments: prefill, popular adapters): one GEMM per segment at its exact
  rank; a segment is heavy when the weight copies the gather would make for it cost more than
  a loop iteration.

A small cost model (ops, MACs, copied weights) picks padded or the gather; otherwise
segments split into light (`_Gather`) and heavy (`_Segments`), both run by `_Parts` when a step
has both. `shrink_torch` / `expand_torch` use the light / heavy split only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import ClassVar

import torch

from . import cpu_fused
from ._checks import check_expand, check_pool, check_rows, check_shrink, check_tables
from .meta import LoRAMeta

# A segment runs its own GEMM when gathering per token would copy at least this many extra
# weight elements ((len - 1) * r * (H_in + H_out)); below it, a loop iteration's fixed cost wins.
HEAVY_MIN_EXTRA_ELEMENTS = 1 << 16
GATHER_MAX_ELEMENTS = 1 << 26  # cap on the gathered [n, r_b, H] copy; past it, loop everything
SMALL_MAX_SEGMENTS = 64  # padded covers at most this many adapters
SMALL_MAX_MACS = 1 << 24  # S * L * r_b * (H_in + H_out), padded's MACs: past it, the other paths
STRATEGIES = ("padded", "gather", "segments")  # what `plan_torch(strategy=)` can force
# No strategy multiplies one adapter's weights by another token's activations, not even masked
# by zeros (0 * NaN = NaN): a "dense" strategy (every token against every live adapter's rows,
# then a block mask) was faster for some tiny batches and is gone for that reason.

# Cost model of one small-batch call on a CPU core, calibrated on the 2-core dev machine (in situ,
# weights not in L1/L2): a torch op's fixed cost, a GEMM MAC, a gathered weight element.
OP_NS, MAC_NS, COPY_NS = 5000.0, 0.05, 0.5
# One adapter's few decode rows in these dtypes run in float32 on the CPU (`_Padded.run`).
_WIDEN_ON_CPU = (torch.bfloat16, torch.float16)
_WIDEN_MAX_ROWS = 8


def _cached_view(views: dict, pool: torch.Tensor, make, shape: int = 0) -> torch.Tensor:
    """A plan's view of `pool`, made once: `views` maps (id(pool), shape) -> (pool, view), and
    holding the pool keeps its id from being reused by another tensor. `shape` tells apart
    several views of one pool."""
    key = (id(pool), shape)
    hit = views.get(key)
    if hit is None or hit[0] is not pool:
        hit = views[key] = (pool, make())
    return hit[1]


@dataclass(slots=True)
class _Gather:
    """Light tokens with their pool rows (sorted by segment): one batched gather for all."""

    name: ClassVar[str] = "gather"
    tok: torch.Tensor  # [n] int64, token index
    flat_rows: torch.Tensor  # [n * r_b] int64, row of the pool viewed as [P * E, H] (own first if masked)
    invalid: torch.Tensor  # [n, r_b] bool, rank index >= the token's slot rank

    def rows_of(self, pool: torch.Tensor) -> torch.Tensor:
        """[n, r_b, H]: each token's rank rows of `pool` (its expert plane for MoE pools)."""
        flat = pool.view(-1, pool.shape[-1]).index_select(0, self.flat_rows)
        return flat.view(*self.invalid.shape, pool.shape[-1])

    def down(self, x: torch.Tensor, A_rows: torch.Tensor) -> torch.Tensor:
        """[n, r_b] in x's dtype: each token's x against its gathered A rows (0 past its rank)."""
        # [n, 1, H] @ [n, H, r_b]: this orientation is ~10x faster on CPU than [n, r_b, H] @ [n, H, 1]
        h = torch.bmm(x[self.tok].unsqueeze(1), self.rows_of(A_rows).transpose(1, 2)).squeeze(1)
        return h.masked_fill_(self.invalid, 0)

    def up(self, y: torch.Tensor, h: torch.Tensor, B_rows: torch.Tensor) -> None:
        """y[tok] += h @ B rows, h [n, r_b] already 0 past each token's rank."""
        delta = torch.bmm(h.to(B_rows.dtype).unsqueeze(1), self.rows_of(B_rows)).squeeze(1)
        y.index_add_(0, self.tok, delta.to(y.dtype))

    def run(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor) -> None:
        """y[tok] += (x[tok] @ A^T) @ B, each token against its own rows."""
        self.up(y, self.down(x, A_rows), B_rows)

    def shrink(self, v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor) -> None:
        """v[tok, :r_b] = x[tok] @ A^T (0 past each token's rank); v [T, R_max]."""
        v[self.tok, : self.invalid.shape[1]] = self.down(x, A_rows).to(v.dtype)

    def expand(self, y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor) -> None:
        """y[tok] += v[tok, :r] @ B; v [T, R_max] (entries past a token's rank ignored)."""
        self.up(y, v[self.tok, : self.invalid.shape[1]].masked_fill(self.invalid, 0), B_rows)


@dataclass(slots=True)
class _Segments:
    """Heavy segments, one GEMM each at its exact rank; each segment is a contiguous range of
    `tok` (its tokens) and of the gathered rows (its rank rows)."""

    name: ClassVar[str] = "segments"
    tok: torch.Tensor  # [m] int64, tokens of the heavy segments, sorted by segment
    flat_rows: torch.Tensor  # [sum r] int64, rows of the pool viewed as [P * E, H]
    bounds: list[tuple[int, int, int, int]]  # per segment: token range, row range
    direct: bool = False  # tok is 0..m-1 (a batch grouped by adapter): slice x and y, no gather

    def rows_of(self, pool: torch.Tensor) -> torch.Tensor:
        """[sum r, H]: every heavy segment's rank rows of `pool`, concatenated."""
        return pool.view(-1, pool.shape[-1]).index_select(0, self.flat_rows)

    def run(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor) -> None:
        """Per segment: y[its tokens] += (x[its tokens] @ A^T) @ B at the segment's rank."""
        A, B = self.rows_of(A_rows), self.rows_of(B_rows)
        if self.direct and A.dtype == x.dtype and B.dtype == y.dtype:  # segments are row ranges
            for t0, t1, r0, r1 in self.bounds:
                y[t0:t1].addmm_(x[t0:t1] @ A[r0:r1].T, B[r0:r1])
            return
        xs = x[self.tok]
        delta = torch.empty(self.tok.numel(), y.shape[1], dtype=B.dtype, device=y.device)
        for t0, t1, r0, r1 in self.bounds:
            torch.mm(xs[t0:t1] @ A[r0:r1].T.to(xs.dtype), B[r0:r1], out=delta[t0:t1])
        y.index_add_(0, self.tok, delta.to(y.dtype))

    def shrink(self, v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor) -> None:
        """v[tok, :r] = x[tok] @ A^T segment by segment; one gather of x and A for all of them."""
        xs, A = x[self.tok], self.rows_of(A_rows)
        hs = torch.zeros(self.tok.numel(), v.shape[1], dtype=x.dtype, device=x.device)
        for t0, t1, r0, r1 in self.bounds:
            torch.mm(xs[t0:t1], A[r0:r1].T, out=hs[t0:t1, : r1 - r0])
        v[self.tok] = hs.to(v.dtype)

    def expand(self, y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor) -> None:
        """y[tok] += v[tok, :r] @ B segment by segment, one index_add_ for all of them."""
        vs, B = v[self.tok].to(B_rows.dtype), self.rows_of(B_rows)  # [m, R_max], [sum r, H_out]
        delta = torch.empty(self.tok.numel(), y.shape[1], dtype=B.dtype, device=y.device)
        for t0, t1, r0, r1 in self.bounds:
            torch.mm(vs[t0:t1, : r1 - r0], B[r0:r1], out=delta[t0:t1])
        y.index_add_(0, self.tok, delta.to(y.dtype))


@dataclass(slots=True)
class _Parts:
    """Several plans over disjoint tokens (light and heavy segments); none = no LoRA token."""

    parts: tuple[_Gather | _Segments, ...] = ()

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.parts) or "none"

    def run(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor) -> None:
        for part in self.parts:
            part.run(y, x, A_rows, B_rows)


@dataclass(slots=True)
class _Padded:
    """Segments padded to the longest one: token blocks [S, L, H_in] against each segment's rank
    rows [S, r_b, H] in two bmm. Each adapter's rows are read once and the MACs are those of the
    padded blocks (S x L x r_b). Rank positions past a segment's own rank (mixed ranks) read
    that segment's own first row and are masked: padding never touches another adapter's rows.

    When the engine has grouped its batch by adapter (it does: `ModelRunner` orders sequences by
    slot) and every segment is L tokens long, x and y are viewed as [S, L, H] in place; when the
    live segments' rows are one run of the pool at one rank, the weights are viewed as [S, r, H].
    The decode step over S adapters is then exactly two bmm with no copy at all."""

    name: ClassVar[str] = "padded"
    vtok: torch.Tensor | None  # [n] int64 token of each LoRA position (None: direct views)
    vpos: torch.Tensor | None  # [n] int64 its place in the flattened [S * L] padded block
    rows: torch.Tensor  # [S * r_b] int64 pool rows (row 0 past a segment's rank, masked)
    row_range: tuple[int, int] | None  # rows are pool[start:stop] (equal ranks): a view
    invalid: torch.Tensor | None  # [S, 1, r_b] bool: rank index past the segment's rank (None: none)
    shape: tuple[int, int, int]  # S, L, r_b
    views: dict = field(default_factory=dict)  # (id(pool), shape) -> (pool, its view)

    def pick(self, pool: torch.Tensor) -> torch.Tensor:
        """[S, r_b, H]: each segment's rank rows of `pool`."""
        s, _, r_b = self.shape
        if self.row_range is None:
            return pool.index_select(0, self.rows).view(s, r_b, -1)
        return _cached_view(self.views, pool,
                            lambda: pool[self.row_range[0]:self.row_range[1]].view(s, r_b, -1))

    def pick_one(self, pool: torch.Tensor) -> torch.Tensor:
        """[r, H]: the rank rows of `pool` of the only segment (S = 1)."""
        if self.row_range is None:
            return pool.index_select(0, self.rows)
        return _cached_view(self.views, pool, lambda: pool[self.row_range[0]:self.row_range[1]], 2)

    def fused_one(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor,
                  B_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The adapter's (A, B) rank rows when `run` adds this step's delta as one
        `cpu_fused.lora_addmm_` over the whole of x and y (one adapter, a few rows, serving on the
        CPU), else None: a caller holding them may make that call itself for the rest of the step."""
        s, length, _ = self.shape
        if (s == 1 and self.vtok is None and A_rows.dtype == x.dtype and B_rows.dtype == y.dtype
                and length <= cpu_fused.LORA_MAX_ROWS and x.shape[0] == length == y.shape[0] and cpu_fused.usable(x)):
            return self.pick_one(A_rows), self.pick_one(B_rows)
        return None

    def run(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor) -> None:
        """Per segment: y[its tokens] += (x[its tokens] @ A^T) @ B, all segments in one bmm pair."""
        s, length, _ = self.shape
        if s == 1 and self.vtok is None and A_rows.dtype == x.dtype and B_rows.dtype == y.dtype:
            # one adapter (the common decode step): two plain GEMMs cost ~5 us less than the bmm pair
            a, b = self.pick_one(A_rows), self.pick_one(B_rows)
            if length <= cpu_fused.LORA_MAX_ROWS and cpu_fused.usable(x):
                # serving a few rows on the CPU: both products in one op, y rounded once
                whole = x.shape[0] == length == y.shape[0]  # every row the adapter's: no slicing
                cpu_fused.lora_addmm_(y if whole else y[:length], x if whole else x[:length], a, b)
                return
            if x.dtype in _WIDEN_ON_CPU and x.is_cpu and length <= _WIDEN_MAX_ROWS:
                # a few rows in bfloat16/float16 on the CPU: oneDNN's reduced-precision GEMM costs
                # 40-50 us a call at these shapes, widening the rank rows and GEMMing in float32
                # about half (bench/RESULTS.md, issue 30 session 13); the sum rounds once, into y
                y[:length].add_((x[:length].float() @ a.float().T) @ b.float())
                return
            y[:length].addmm_(x[:length] @ a.T, b)
            return
        if self.vtok is None:
            xs = x[: s * length].view(s, length, -1)
        else:
            xs = x.new_zeros(s * length, x.shape[1]).index_copy_(0, self.vpos, x.index_select(0, self.vtok))
            xs = xs.view(s, length, -1)
        h = torch.bmm(xs, self.pick(A_rows).transpose(1, 2).to(x.dtype))  # [S, L, r_b]
        if self.invalid is not None:
            h.masked_fill_(self.invalid, 0)
        b = self.pick(B_rows)
        if self.vtok is None and b.dtype == y.dtype:
            y[: s * length].view(s, length, -1).baddbmm_(h.to(b.dtype), b)
            return
        delta = torch.bmm(h.to(b.dtype), b).view(s * length, -1)
        if self.vtok is None:
            y[: s * length].add_(delta.to(y.dtype))
        else:
            y.index_add_(0, self.vtok, delta.index_select(0, self.vpos).to(y.dtype))


@dataclass(slots=True)
class _Layout:
    """The live segments of a small batch (dense pools, CPU metadata), as the padded plan needs
    them: S segments of `lengths` tokens at `seg_ranks`, r_b the largest rank."""

    lengths: list[int]
    seg_ranks: list[int]
    tok: torch.Tensor  # [n] int64 LoRA tokens in segment order
    prefix: bool  # tok is 0..n-1: the LoRA tokens are rows [0, n)
    table: torch.Tensor  # [S, r_b] int64 each segment's pool rows
    in_rank: torch.Tensor  # [S, r_b] bool: within the segment's rank
    rows: torch.Tensor  # [sum r] int64 each segment's own rows, concatenated
    run: tuple[int, int] | None  # rows are pool[start:stop]

    @property
    def equal_ranks(self) -> bool:
        return min(self.seg_ranks) == self.table.shape[1]

    @property
    def direct(self) -> bool:
        """x and y can be viewed as [S, L, H]: prefix layout, every segment L tokens long."""
        return self.prefix and min(self.lengths) == max(self.lengths)


Plan = _Gather | _Segments | _Parts | _Padded  # what plan_torch returns


def _contiguous_run(rows: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) when `rows` is exactly start, start + 1, ..., stop - 1; else None."""
    first, total = int(rows[0]), rows.numel()
    return (first, first + total) if bool((rows == torch.arange(first, first + total)).all()) else None


def _check_ranks(seg_ranks: list[int], row_table: torch.Tensor) -> None:
    """Ranks past the row table's width would read other slots' rows: refuse them."""
    if seg_ranks and max(seg_ranks) > row_table.shape[1]:
        raise ValueError(f"ranks holds {max(seg_ranks)} > R_max={row_table.shape[1]}")


def _small_layout(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, num_experts: int,
                  width: int) -> _Layout | None:
    """The layout the padded plan runs on; None when it does not apply (MoE pools, device
    metadata, too many segments, no rank, or more MACs than a small batch)."""
    if num_experts > 1 or meta.device.type != "cpu":
        return None
    s = int(meta.num_segments)
    if not 0 < s <= SMALL_MAX_SEGMENTS:
        return None
    starts = meta.seg_start[: s + 1].tolist()
    seg_ranks = ranks[meta.seg_slot[:s].long()].tolist()
    _check_ranks(seg_ranks, row_table)
    lengths = [b - a for a, b in pairwise(starts)]
    n, r_b = starts[-1], max(seg_ranks)
    if min(seg_ranks) == 0:  # a segment without LoRA on this kind has no rows of its own to pad
        return None          # with: the split below leaves it out
    if s * max(lengths) * r_b * width > SMALL_MAX_MACS:
        return None
    tok = meta.token_ids[:n].long()
    table = row_table[meta.seg_slot[:s].long(), :r_b].long()  # [S, r_b]
    in_rank = torch.arange(r_b)[None, :] < torch.tensor(seg_ranks)[:, None]  # [S, r_b]
    rows = table.flatten() if min(seg_ranks) == r_b else table[in_rank]  # each segment's own ranks
    return _Layout(lengths, seg_ranks, tok, bool((tok == torch.arange(n)).all()), table, in_rank,
                   rows, _contiguous_run(rows))


def _small_costs(lay: _Layout, width: int) -> dict[str, float]:
    """Estimated ns of padded and the gather for one call (ties go to the first)."""
    s, n, r_b = len(lay.lengths), len(lay.tok), lay.table.shape[1]
    copied = lay.run is None
    padded_views = not copied and lay.equal_ranks
    return {
        "padded": (OP_NS * (2 + (not lay.equal_ranks) + 4 * (not lay.direct) + 2 * (not padded_views))
                   + MAC_NS * s * max(lay.lengths) * r_b * width
                   + COPY_NS * (not padded_views) * s * r_b * width),
        "gather": OP_NS * 7 + (MAC_NS + COPY_NS) * n * r_b * width,
    }


def _padded_plan(lay: _Layout) -> _Padded:
    """The padded plan of `lay`: where each LoRA token sits in the [S * L] block (none when x and
    y are viewed in place), each segment's rows, and the rank mask when ranks differ."""
    (s, r_b), lengths, length = lay.table.shape, lay.lengths, max(lay.lengths)
    invalid = ~lay.in_rank
    vtok = vpos = None
    if not lay.direct:
        tok_seg = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths))
        seg_first = torch.tensor([0] + lengths[:-1]).cumsum(0)
        vtok, vpos = lay.tok, tok_seg * length + torch.arange(len(lay.tok)) - seg_first[tok_seg]
    own = torch.where(invalid, lay.table[:, :1], lay.table)  # pads read the segment's own row
    return _Padded(vtok, vpos, own.flatten(),
                   lay.run if lay.equal_ranks else None,
                   invalid[:, None, :] if bool(invalid.any()) else None, (s, length, r_b))


def _small_plan(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, num_experts: int,
                width: int, strategy: str | None) -> _Padded | None:
    """Padded, when forced or when the cost model prices it below the gather; None when the
    gather is priced lower or padded does not apply."""
    lay = _small_layout(meta, row_table, ranks, num_experts, width)
    if lay is None:
        return None
    if strategy is None:
        costs = _small_costs(lay, width)
        strategy = min(costs, key=costs.get)
    if strategy == "gather":
        return None
    return _padded_plan(lay)


def _split(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, num_experts: int,
           width: int, strategy: str | None = None) -> tuple[_Gather | None, _Segments | None]:
    """Live segments split into light (gathered) and heavy (own GEMM); `width` = H_in + H_out.
    strategy "gather" / "segments" puts every segment on one side."""
    s = int(meta.num_segments)
    starts = meta.seg_start[: s + 1]
    lengths = starts[1:] - starts[:-1]
    len_list, r_list = lengths.tolist(), ranks[meta.seg_slot[:s]].tolist()
    _check_ranks(r_list, row_table)
    heavy = [r > 0 and (strategy == "segments" or strategy is None
                        and (ln - 1) * r * width >= HEAVY_MIN_EXTRA_ELEMENTS)
             for ln, r in zip(len_list, r_list)]
    n_light = sum(ln for ln, h, r in zip(len_list, heavy, r_list) if not h and r > 0)
    if strategy is None and n_light * max(r_list, default=0) * width > GATHER_MAX_ELEMENTS:
        heavy, n_light = [r > 0 for r in r_list], 0
    light = None
    if n_light:  # the light tokens: segments neither heavy nor without LoRA on this kind
        light_segs = [not h and r > 0 for h, r in zip(heavy, r_list)]
        pos = None if all(light_segs) else _positions(lengths, light_segs)
        light = _gather_plan(meta, row_table, ranks, int(starts[-1]), pos, num_experts)
    if not any(heavy):
        return light, None
    return light, _segments_plan(meta, row_table, s, lengths, len_list, r_list, heavy, num_experts)


def _positions(lengths: torch.Tensor, keep: list[bool]) -> torch.Tensor:
    """Sorted-order positions of the tokens of the segments flagged in `keep`."""
    flags = torch.tensor(keep, device=lengths.device)
    return torch.repeat_interleave(flags, lengths).nonzero().squeeze(1)


def _segments_plan(meta: LoRAMeta, row_table: torch.Tensor, s: int, lengths: torch.Tensor,
                   len_list: list[int], r_list: list[int], heavy: list[bool],
                   num_experts: int) -> _Segments:
    """The heavy segments' tokens, rows (their expert plane for MoE pools) and ranges."""
    idx = [i for i, h in enumerate(heavy) if h]
    slots = meta.seg_slot[:s][idx].long()
    r_heavy = torch.tensor([r_list[i] for i in idx], device=slots.device)
    rows = row_table[slots].long()  # [S_h, R_max]
    if num_experts > 1:
        rows = rows * num_experts + meta.seg_expert[:s][idx].long()[:, None]
    in_rank = torch.arange(rows.shape[1], device=rows.device) < r_heavy[:, None]
    tok = (meta.token_ids[: int(meta.seg_start[s])] if all(heavy) else
           meta.token_ids.index_select(0, _positions(lengths, heavy))).long()
    bounds, t0, r0 = [], 0, 0
    for i in idx:
        bounds.append((t0, t0 + len_list[i], r0, r0 + r_list[i]))
        t0, r0 = t0 + len_list[i], r0 + r_list[i]
    direct = bool((tok == torch.arange(tok.numel(), device=tok.device)).all())
    return _Segments(tok, rows[in_rank], bounds, direct)


def _gather_plan(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, n: int,
                 pos: torch.Tensor | None, num_experts: int) -> _Gather | None:
    """Rows of the light tokens at sorted positions `pos` (None = all `n` LoRA tokens)."""
    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[:n] if pos is None else t.index_select(0, pos)

    slots = pick(meta.sorted_slots)
    tok_rank = ranks[slots]  # [n]
    r_b = int(tok_rank.max())
    if r_b == 0:
        return None
    invalid = torch.arange(r_b, device=slots.device) >= tok_rank[:, None]  # [n, r_b]
    rows = row_table[slots, :r_b].long()
    if num_experts > 1:
        rows = rows * num_experts + pick(meta.sorted_experts)[:, None]
    # rank positions past a token's own read its own first row (then masked): never another's
    rows = torch.where(invalid, rows[:, :1], rows)
    return _Gather(pick(meta.token_ids).long(), rows.flatten(), invalid)


def _num_experts(pool: torch.Tensor) -> int:
    """E of an MoE pool [P, E, H]; 1 for a dense pool [P, H]."""
    return pool.shape[1] if pool.dim() == 3 else 1


def shrink_torch(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for LoRA tokens; every other entry of v is set to 0."""
    check_shrink(v, x, A_rows, row_table, ranks, meta)
    v.zero_()
    for part in _split(meta, row_table, ranks, _num_experts(A_rows), x.shape[1] * 2):
        if part is not None:
            part.shrink(v, x, A_rows)


def expand_torch(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """y[t] += v[t, :r(a)] @ B[a]^T for LoRA tokens, in place."""
    check_expand(y, v, B_rows, row_table, ranks, meta)
    for part in _split(meta, row_table, ranks, _num_experts(B_rows), y.shape[1] * 2):
        if part is not None:
            part.expand(y, v, B_rows)


def plan_torch(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, A_rows: torch.Tensor,
               B_rows: torch.Tensor, *, strategy: str | None = None) -> Plan:
    """How `add_lora_torch` covers one step's LoRA tokens for one target kind; `.run(y, x,
    A_rows, B_rows)` applies it with no checks. Every layer of that kind shares it (same
    metadata, row table, ranks and widths), saving the host-side planning of every other call.

    strategy: None lets the cost model choose; one of STRATEGIES forces it (tests, benchmarks)
    where it applies. "gather" and "segments" apply everywhere; where padded does not (MoE
    pools, CUDA metadata, batches past SMALL_MAX_SEGMENTS or SMALL_MAX_MACS), the light / heavy
    split covers the call. The plan's `name` says what runs."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    num_experts, width = _num_experts(A_rows), A_rows.shape[-1] + B_rows.shape[-1]
    if strategy in (None, "padded"):
        small = _small_plan(meta, row_table, ranks, num_experts, width, strategy)
        if small is not None:
            return small
        strategy = None  # no small plan (or the gather is priced lower): the split's own rule
    parts = tuple(p for p in _split(meta, row_table, ranks, num_experts, width, strategy) if p is not None)
    return parts[0] if len(parts) == 1 else _Parts(parts)


def _check_add(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
               row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """add_lora's shape / dtype / device / layout preconditions (shrink's and expand's, less
    those of the rank-space buffer this backend does not use)."""
    check_rows("x", x, meta)
    check_pool("A_rows", A_rows, x.shape[1], meta, x.dtype)
    check_tables(row_table, ranks, meta.device)
    check_rows("y", y, meta)
    check_pool("B_rows", B_rows, y.shape[1], meta, y.dtype)


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                   row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta,
                   plan: Plan | None = None) -> None:
    """y[t] += B[a] @ (A[a] @ x[t]) after checking the inputs; the rank-space product stays
    compact. plan: from `plan_torch` for this step and target kind (else planned here)."""
    _check_add(y, x, A_rows, B_rows, row_table, ranks, meta)
    if plan is None:
        plan = plan_torch(meta, row_table, ranks, A_rows, B_rows)
    plan.run(y, x, A_rows, B_rows)


@dataclass(slots=True)
class _Scope:
    """The plans built for one LoRAMeta, by caller key."""

    meta: LoRAMeta | None = None  # held, so its id is never reused while the plans live
    plans: dict = field(default_factory=dict)  # key -> plan
    built: list = field(default_factory=list)  # (row_table, ranks, plan), to share between keys

    def shared(self, row_table: torch.Tensor, ranks: torch.Tensor) -> Plan | None:
        """A plan built for another key with the same rows: adapters that target every kind at
        one rank get identical row tables in each kind's pool (the free lists hand rows out in
        the same order), so q/k/v/o/gate/up/down share one plan."""
        for table, rk, plan in self.built:
            if torch.equal(rk, ranks) and torch.equal(table, row_table):
                return plan
        return None


class PlanCache:
    """The torch backend's plans of the current step, built by the first call of each key (the
    caller's: target kind for dense targets, (kind, layer) for MoE) and run directly by the
    others, which skip the input checks: they have the shapes of that checked first call.

    Plans live as long as the caller passes the same `LoRAMeta` object: a new one (a new step
    layout, a pool change, the next MoE layer's routing) drops them. So a steady-state decode
    step that reuses the previous step's metadata reuses its plans too. A caller that rebuilds
    metadata in place into the same object must call `reset()`. Dense and MoE targets keep
    separate scopes, since a step's calls interleave them layer by layer."""

    __slots__ = ("strategy", "_scopes")

    def __init__(self, strategy: str | None = None):
        self.strategy = strategy  # forwarded to plan_torch: None = the cost model
        self._scopes = [_Scope(), _Scope()]  # dense targets, MoE targets (index: meta.moe)

    def reset(self) -> None:
        self._scopes = [_Scope(), _Scope()]

    def fused_one(self, key, meta: LoRAMeta, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor,
                  B_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After `add(key, ...)` with `meta`: the adapter's (A, B) rank rows when its plan adds the
        delta as one `lora_addmm_` of the whole rows (`_Padded.fused_one`), else None."""
        scope = self._scopes[meta.moe]
        plan = scope.plans.get(key) if scope.meta is meta else None
        return plan.fused_one(y, x, A_rows, B_rows) if isinstance(plan, _Padded) else None

    def add(self, key, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
            row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta) -> None:
        """y += LoRA(x) for one target module, as `add_lora_torch`, with the step's plan."""
        scope = self._scopes[meta.moe]
        if scope.meta is meta:
            plan = scope.plans.get(key)
            if plan is not None:
                plan.run(y, x, A_rows, B_rows)
                return
        else:
            scope = self._scopes[meta.moe] = _Scope(meta)
        plan = scope.shared(row_table, ranks)
        if plan is None:
            plan = plan_torch(meta, row_table, ranks, A_rows, B_rows, strategy=self.strategy)
            scope.built.append((row_table, ranks, plan))
        scope.plans[key] = plan
        add_lora_torch(y, x, A_rows, B_rows, row_table, ranks, meta, plan)
