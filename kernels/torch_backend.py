"""The `torch` backend: vectorised LoRA ops for CPU (and, slower, any device). Same semantics as
the Triton kernels and `reference.py`.

Each call splits the step's live segments in two, from host-side sizes (free on CPU, one sync on
CUDA):

- *light* segments (decode: one or a few tokens per adapter) go through one batched *gather*:
  each token's rank rows are gathered into `[n, r_b, H]` and multiplied with one `bmm`; a fixed
  ~15 torch ops however many adapters there are. `r_b` is the largest rank among these tokens;
  rank indices past a token's own rank are masked to zero.
- *heavy* segments (prefill, popular adapters) get one GEMM each at their exact rank: Python work
  is O(heavy segments), but a segment is heavy only when the weight copies the gather would make
  for it cost more than a loop iteration.

`add_lora` has two more strategies for small batches over at most 64 adapters (the common decode
step), both reading each adapter's rows once with no per-token weight copy: *dense* (all LoRA
tokens against the concatenated rank rows in two GEMMs, a block mask keeping each token's own
adapter; fewest ops) and *padded* (segments padded to the longest into [S, L, H] blocks, two bmm
against each segment's rows; fewest MACs). A small cost model (ops, MACs, copied weights) picks
among them and the gather. Since the engine groups its batch by adapter, a decode step usually
runs with no copy at all: x, y and the pool rows are all views (see `_Padded`).
`plan_torch` builds the plan once per step and target kind; every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch

from ._checks import check_expand, check_shrink
from .meta import LoRAMeta

# A segment runs its own GEMM when gathering per token would copy at least this many extra
# weight elements ((len - 1) * r * (H_in + H_out)); below it, a loop iteration's fixed cost wins.
HEAVY_MIN_EXTRA_ELEMENTS = 1 << 16
GATHER_MAX_ELEMENTS = 1 << 26  # cap on the gathered [n, r_b, H] copy; past it, loop everything


@dataclass(slots=True)
class _Gathered:
    """Light tokens with their pool rows (sorted by segment)."""

    tok: torch.Tensor  # [n] int64, token index
    flat_rows: torch.Tensor  # [n * r_b] int64, row of the pool viewed as [P * E, H] (0 if masked)
    invalid: torch.Tensor  # [n, r_b] bool, rank index >= the token's slot rank

    def rows_of(self, pool: torch.Tensor) -> torch.Tensor:
        """[n, r_b, H]: each token's rank rows of `pool` (its expert plane for MoE pools)."""
        flat = pool.view(-1, pool.shape[-1]).index_select(0, self.flat_rows)
        return flat.view(*self.invalid.shape, pool.shape[-1])


@dataclass(slots=True)
class _Heavy:
    """Heavy segments' tokens and rows, each segment a contiguous range of both."""

    tok: torch.Tensor  # [m] int64, tokens of the heavy segments, sorted by segment
    flat_rows: torch.Tensor  # [sum r] int64, rows of the pool viewed as [P * E, H]
    bounds: list[tuple[int, int, int, int]]  # per segment: token range, row range
    direct: bool = False  # tok is 0..m-1 (a batch grouped by adapter): slice x and y, no gather

    def rows_of(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(-1, pool.shape[-1]).index_select(0, self.flat_rows)  # [sum r, H]


def _cached_view(views: dict, pool: torch.Tensor, make) -> torch.Tensor:
    """A plan's view of `pool`, made once: `views` maps id(pool) -> (pool, view), and holding
    the pool keeps its id from being reused by another tensor."""
    hit = views.get(id(pool))
    if hit is None or hit[0] is not pool:
        hit = views[id(pool)] = (pool, make())
    return hit[1]


@dataclass(slots=True)
class _Dense:
    """Few adapters in a small batch: every LoRA token against the rank rows of every live
    segment in two dense GEMMs, then a block mask keeps each token's own adapter. Reads each
    adapter's rows once (no per-token weight copies) at the price of S x the (tiny) MACs."""

    tok: torch.Tensor | None  # [n] int64 LoRA tokens in sorted order; None = they are rows [0, n)
    n: int  # LoRA tokens
    rows: torch.Tensor  # [sum r] int64 pool rows of the live segments, concatenated
    other: torch.Tensor | None  # [n, sum r] bool: column of another token's segment (None: S = 1)
    row_range: tuple[int, int] | None  # rows are pool[start:stop]: views, no copy
    views: dict = field(default_factory=dict)  # id(pool) -> (pool, its view)

    def pick(self, pool: torch.Tensor) -> torch.Tensor:
        """[sum r, H]: the live segments' rows of `pool`."""
        if self.row_range is None:
            return pool.index_select(0, self.rows)
        return _cached_view(self.views, pool, lambda: pool[self.row_range[0]:self.row_range[1]])


@dataclass(slots=True)
class _Padded:
    """Segments padded to the longest one: token blocks [S, L, H_in] against each segment's rank
    rows [S, r_b, H] in two bmm. Each adapter's rows are read once and the MACs are those of the
    padded blocks (S x L x r_b), not S x those of every token (the dense strategy's cost).

    When the engine has grouped its batch by adapter (it does: `ModelRunner` orders sequences by
    slot) and every segment is L tokens long, x and y are viewed as [S, L, H] in place; when the
    live segments' rows are one run of the pool at one rank, the weights are viewed as [S, r, H].
    The decode step over S adapters is then exactly two bmm with no copy at all."""

    vtok: torch.Tensor | None  # [n] int64 token of each LoRA position (None: direct views)
    vpos: torch.Tensor | None  # [n] int64 its place in the flattened [S * L] padded block
    rows: torch.Tensor  # [S * r_b] int64 pool rows (row 0 past a segment's rank, masked)
    row_range: tuple[int, int] | None  # rows are pool[start:stop] (equal ranks): a view
    invalid: torch.Tensor | None  # [S, 1, r_b] bool: rank index past the segment's rank (None: none)
    shape: tuple[int, int, int]  # S, L, r_b
    views: dict = field(default_factory=dict)  # id(pool) -> (pool, its [S, r_b, H] view)

    def pick(self, pool: torch.Tensor) -> torch.Tensor:
        """[S, r_b, H]: each segment's rank rows of `pool`."""
        s, _, r_b = self.shape
        if self.row_range is None:
            return pool.index_select(0, self.rows).view(s, r_b, -1)
        return _cached_view(self.views, pool,
                            lambda: pool[self.row_range[0]:self.row_range[1]].view(s, r_b, -1))


@dataclass(slots=True)
class _Plan:
    """How one call covers the step's LoRA tokens for one target."""

    light: _Gathered | None = None
    heavy: _Heavy | None = None
    dense: _Dense | None = None
    padded: _Padded | None = None

    def run(self, y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor) -> None:
        """y += LoRA(x) over this plan's tokens, no checks (see `add_lora_torch`)."""
        if self.padded is not None:
            _add_padded(y, x, A_rows, B_rows, self.padded)
            return
        if self.dense is not None:
            _add_dense(y, x, A_rows, B_rows, self.dense)
            return
        if self.light is not None:
            _expand_gathered(y, _shrink_gathered(x, A_rows, self.light), B_rows, self.light)
        if self.heavy is not None:
            hv = self.heavy
            A, B = hv.rows_of(A_rows), hv.rows_of(B_rows)
            if hv.direct and A.dtype == x.dtype and B.dtype == y.dtype:  # segments are row ranges
                for t0, t1, r0, r1 in hv.bounds:
                    y[t0:t1].addmm_(x[t0:t1] @ A[r0:r1].T, B[r0:r1])
                return
            xs = x[hv.tok]
            delta = torch.empty(hv.tok.numel(), y.shape[1], dtype=B.dtype, device=y.device)
            for t0, t1, r0, r1 in hv.bounds:
                torch.mm(xs[t0:t1] @ A[r0:r1].T.to(xs.dtype), B[r0:r1], out=delta[t0:t1])
            y.index_add_(0, hv.tok, delta.to(y.dtype))


DENSE_MAX_SEGMENTS = 64  # the small-batch strategies (dense, padded) cover at most this many adapters
DENSE_MAX_MACS = 1 << 24  # n * sum(r) * (H_in + H_out): past it (prefill), use the other paths
FORCE_SMALL: str | None = None  # tests: "dense" or "padded" overrides the cost model below

# Cost model of one small-batch call on a CPU core, calibrated on the 2-core dev machine (in situ,
# weights not in L1/L2): a torch op's fixed cost, a GEMM MAC, a gathered weight element.
OP_NS, MAC_NS, COPY_NS = 5000.0, 0.05, 0.5


def _contiguous_run(rows: torch.Tensor) -> tuple[int, int] | None:
    first, total = int(rows[0]), rows.numel()
    return (first, first + total) if bool((rows == torch.arange(first, first + total)).all()) else None


def _small_plan(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, num_experts: int,
                width: int) -> _Dense | _Padded | None:
    """Dense or padded for a small batch over few adapters (dense pools, CPU metadata), whichever
    the cost model prices lower; None when neither applies."""
    if num_experts > 1 or meta.device.type != "cpu":
        return None
    s = int(meta.num_segments)
    if not 0 < s <= DENSE_MAX_SEGMENTS:
        return None
    starts = meta.seg_start[: s + 1].tolist()
    slots = meta.seg_slot[:s].long().tolist()
    seg_ranks = ranks[slots].tolist()
    r_b = max(seg_ranks)
    if r_b > row_table.shape[1]:
        raise ValueError(f"ranks holds {r_b} > R_max={row_table.shape[1]}")
    n, total = starts[-1], sum(seg_ranks)
    lengths = [b - a for a, b in pairwise(starts)]
    length = max(lengths)
    if total == 0 or min(n * total, s * length * r_b) * width > DENSE_MAX_MACS:
        return None
    tok = meta.token_ids[:n].long()
    prefix = bool((tok == torch.arange(n)).all())  # LoRA tokens are rows [0, n), in segment order
    equal_ranks = min(seg_ranks) == r_b
    table = row_table[meta.seg_slot[:s].long(), :r_b].long()  # [S, r_b]
    in_rank = torch.arange(r_b)[None, :] < torch.tensor(seg_ranks)[:, None]  # [S, r_b]
    rows = table.flatten() if equal_ranks else table[in_rank]  # each segment's own ranks
    run = _contiguous_run(rows)
    direct = prefix and min(lengths) == length
    dense_ns = (OP_NS * (2 + (s > 1) + 2 * (not prefix) + 2 * (run is None))
                + MAC_NS * n * total * width + COPY_NS * (run is None) * total * width)
    padded_views = run is not None and equal_ranks
    padded_ns = (OP_NS * (2 + (not equal_ranks) + 4 * (not direct) + 2 * (not padded_views))
                 + MAC_NS * s * length * r_b * width + COPY_NS * (not padded_views) * s * r_b * width)
    gather_ns = OP_NS * 7 + (MAC_NS + COPY_NS) * n * r_b * width  # the light path (None here)
    if FORCE_SMALL is None and gather_ns < min(dense_ns, padded_ns):
        return None
    use_padded = padded_ns < dense_ns if FORCE_SMALL is None else FORCE_SMALL == "padded"
    if use_padded:
        return _padded_plan(table, in_rank, lengths, tok, direct, run if padded_views else None)
    other = None
    if s > 1:
        col_seg = torch.repeat_interleave(torch.arange(s), torch.tensor(seg_ranks))
        tok_seg = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths))
        other = tok_seg[:, None] != col_seg[None, :]
    return _Dense(None if prefix else tok, n, rows, other, run)


def _padded_plan(table: torch.Tensor, in_rank: torch.Tensor, lengths: list[int], tok: torch.Tensor,
                 direct: bool, row_range: tuple[int, int] | None) -> _Padded:
    """table / in_rank [S, r_b]: each segment's pool rows and which of them are within its rank."""
    (s, r_b), length = table.shape, max(lengths)
    invalid = ~in_rank
    vtok = vpos = None
    if not direct:
        tok_seg = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths))
        seg_first = torch.tensor([0] + lengths[:-1]).cumsum(0)
        vtok, vpos = tok, tok_seg * length + torch.arange(tok.numel()) - seg_first[tok_seg]
    return _Padded(vtok, vpos, table.masked_fill(invalid, 0).flatten(), row_range,
                   invalid[:, None, :] if bool(invalid.any()) else None, (s, length, r_b))


def _plan(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, num_experts: int,
          width: int, allow_segments: bool = False) -> _Plan:
    """Split live segments into light (gathered) and heavy (own GEMM); `width` = H_in + H_out.
    allow_segments (add_lora only): few segments in a small batch use the `dense` strategy."""
    found = _as_plan(_small_plan(meta, row_table, ranks, num_experts, width)) if allow_segments else None
    if found is not None:
        return found
    s = int(meta.num_segments)
    starts = meta.seg_start[: s + 1]
    lengths = starts[1:] - starts[:-1]
    seg_ranks = ranks[meta.seg_slot[:s]]
    len_list, r_list = lengths.tolist(), seg_ranks.tolist()
    if r_list and max(r_list) > row_table.shape[1]:
        raise ValueError(f"ranks holds {max(r_list)} > R_max={row_table.shape[1]}")
    heavy = [r > 0 and (ln - 1) * r * width >= HEAVY_MIN_EXTRA_ELEMENTS
             for ln, r in zip(len_list, r_list)]
    n_light = sum(ln for ln, h, r in zip(len_list, heavy, r_list) if not h and r > 0)
    if n_light * max(r_list, default=0) * width > GATHER_MAX_ELEMENTS:
        heavy, n_light = [r > 0 for r in r_list], 0
    plan = _Plan()
    n = int(starts[-1]) if s else 0
    if n_light:
        pos = None if not any(heavy) else _positions(lengths, [not h for h in heavy])
        plan.light = _gather_plan(meta, row_table, ranks, n, pos, num_experts)
    if any(heavy):
        plan.heavy = _heavy_plan(meta, row_table, s, lengths, len_list, r_list, heavy,
                                 num_experts)
    return plan


def _positions(lengths: torch.Tensor, keep: list[bool]) -> torch.Tensor:
    """Sorted-order positions of the tokens of the segments flagged in `keep`."""
    flags = torch.tensor(keep, device=lengths.device)
    return torch.repeat_interleave(flags, lengths).nonzero().squeeze(1)


def _heavy_plan(meta: LoRAMeta, row_table: torch.Tensor, s: int, lengths: torch.Tensor,
                len_list: list[int], r_list: list[int], heavy: list[bool],
                num_experts: int) -> _Heavy:
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
    return _Heavy(tok, rows[in_rank], bounds, direct)


def _gather_plan(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, n: int,
                 pos: torch.Tensor | None, num_experts: int) -> _Gathered | None:
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
    return _Gathered(pick(meta.token_ids).long(), rows.masked_fill_(invalid, 0).flatten(),
                     invalid)


def _num_experts(pool: torch.Tensor) -> int:
    return pool.shape[1] if pool.dim() == 3 else 1


def shrink_torch(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """v[t, :r(a)] = x[t] @ A[a]^T for LoRA tokens; every other entry of v is set to 0."""
    check_shrink(v, x, A_rows, row_table, ranks, meta)
    v.zero_()
    plan = _plan(meta, row_table, ranks, _num_experts(A_rows), x.shape[1] * 2)
    if plan.light is not None:
        g = plan.light
        v[g.tok, : g.invalid.shape[1]] = _shrink_gathered(x, A_rows, g).to(v.dtype)
    if plan.heavy is not None:
        _shrink_heavy(v, x, A_rows, plan.heavy)


def expand_torch(y: torch.Tensor, v: torch.Tensor, B_rows: torch.Tensor, row_table: torch.Tensor,
                 ranks: torch.Tensor, meta: LoRAMeta) -> None:
    """y[t] += v[t, :r(a)] @ B[a]^T for LoRA tokens, in place."""
    check_expand(y, v, B_rows, row_table, ranks, meta)
    plan = _plan(meta, row_table, ranks, _num_experts(B_rows), y.shape[1] * 2)
    if plan.light is not None:
        g = plan.light
        _expand_gathered(y, v[g.tok, : g.invalid.shape[1]].masked_fill(g.invalid, 0), B_rows, g)
    if plan.heavy is not None:
        hv = plan.heavy
        vs = v[hv.tok].to(B_rows.dtype)  # [m, R_max]
        B = hv.rows_of(B_rows)  # [sum r, H_out]
        delta = torch.empty(hv.tok.numel(), y.shape[1], dtype=B.dtype, device=y.device)
        for t0, t1, r0, r1 in hv.bounds:
            torch.mm(vs[t0:t1, : r1 - r0], B[r0:r1], out=delta[t0:t1])
        y.index_add_(0, hv.tok, delta.to(y.dtype))


def plan_torch(meta: LoRAMeta, row_table: torch.Tensor, ranks: torch.Tensor, A_rows: torch.Tensor,
               B_rows: torch.Tensor) -> _Plan:
    """The row gathers of one step for one target kind. Every layer of that kind shares it (same
    metadata, same row table and ranks, same widths), so the engine builds it once per step and
    passes it to `add_lora_torch(..., plan=)`, saving the host-side planning of every other call."""
    return _plan(meta, row_table, ranks, _num_experts(A_rows), A_rows.shape[-1] + B_rows.shape[-1],
                 allow_segments=True)


def _as_plan(found: _Dense | _Padded | None) -> _Plan | None:
    if found is None:
        return None
    return _Plan(padded=found) if isinstance(found, _Padded) else _Plan(dense=found)


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                   row_table: torch.Tensor, ranks: torch.Tensor, meta: LoRAMeta,
                   buffer: torch.Tensor | None = None, plan: _Plan | None = None,
                   check: bool = True) -> None:
    """y[t] += B[a] @ (A[a] @ x[t]); the rank-space product stays compact (buffer unused).

    plan: from `plan_torch` for this step and target kind (else planned here). check=False skips
    the input checks: for the later layers of a step whose first call checked the same shapes."""
    if check:
        buffer = buffer if buffer is not None else torch.empty(x.shape[0], row_table.shape[1], device=x.device)
        check_shrink(buffer, x, A_rows, row_table, ranks, meta)
        check_expand(y, buffer, B_rows, row_table, ranks, meta)
    if plan is None:
        plan = _plan(meta, row_table, ranks, _num_experts(A_rows), x.shape[1] + y.shape[1],
                     allow_segments=True)
    plan.run(y, x, A_rows, B_rows)


def _add_dense(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
               d: _Dense) -> None:
    """y[tok] += ((x[tok] @ A_all^T) * own-block mask) @ B_all."""
    xs = x[: d.n] if d.tok is None else x.index_select(0, d.tok)
    A = d.pick(A_rows)
    h = torch.mm(xs, A.T if A.dtype == xs.dtype else A.T.to(xs.dtype))
    if d.other is not None:
        h.masked_fill_(d.other, 0)
    B = d.pick(B_rows)
    if d.tok is None and B.dtype == y.dtype:
        y[: d.n].addmm_(h if h.dtype == B.dtype else h.to(B.dtype), B)
        return
    delta = (h.to(B.dtype) @ B).to(y.dtype)
    if d.tok is None:
        y[: d.n].add_(delta)
    else:
        y.index_add_(0, d.tok, delta)


def _add_padded(y: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, B_rows: torch.Tensor,
                p: _Padded) -> None:
    """Per segment: y[its tokens] += (x[its tokens] @ A^T) @ B, all segments in one bmm pair."""
    s, length, _ = p.shape
    if p.vtok is None:
        xs = x[: s * length].view(s, length, -1)
    else:
        xs = x.new_zeros(s * length, x.shape[1]).index_copy_(0, p.vpos, x.index_select(0, p.vtok))
        xs = xs.view(s, length, -1)
    h = torch.bmm(xs, p.pick(A_rows).transpose(1, 2).to(x.dtype))  # [S, L, r_b]
    if p.invalid is not None:
        h.masked_fill_(p.invalid, 0)
    b = p.pick(B_rows)
    if p.vtok is None and b.dtype == y.dtype:
        y[: s * length].view(s, length, -1).baddbmm_(h.to(b.dtype), b)
        return
    delta = torch.bmm(h.to(b.dtype), b).view(s * length, -1)
    if p.vtok is None:
        y[: s * length].add_(delta.to(y.dtype))
    else:
        y.index_add_(0, p.vtok, delta.index_select(0, p.vpos).to(y.dtype))


def _shrink_heavy(v: torch.Tensor, x: torch.Tensor, A_rows: torch.Tensor, hv: _Heavy) -> None:
    """v[tok, :r] = x[tok] @ A^T segment by segment; one gather of x and A for all of them."""
    xs, A = x[hv.tok], hv.rows_of(A_rows)
    hs = torch.zeros(hv.tok.numel(), v.shape[1], dtype=x.dtype, device=x.device)
    for t0, t1, r0, r1 in hv.bounds:
        torch.mm(xs[t0:t1], A[r0:r1].T, out=hs[t0:t1, : r1 - r0])
    v[hv.tok] = hs.to(v.dtype)


def _shrink_gathered(x: torch.Tensor, A_rows: torch.Tensor, g: _Gathered) -> torch.Tensor:
    """[n, r_b] in x's dtype: each token's x against its gathered A rows (masked rows are 0)."""
    # [n, 1, H] @ [n, H, r_b]: this orientation is ~10x faster on CPU than [n, r_b, H] @ [n, H, 1]
    h = torch.bmm(x[g.tok].unsqueeze(1), g.rows_of(A_rows).transpose(1, 2)).squeeze(1)
    return h.masked_fill_(g.invalid, 0)


def _expand_gathered(y: torch.Tensor, h: torch.Tensor, B_rows: torch.Tensor,
                     g: _Gathered) -> None:
    """y[tok] += h @ B rows, h [n, r_b] already 0 past each token's rank."""
    h = h.to(B_rows.dtype)
    delta = torch.bmm(h.unsqueeze(1), g.rows_of(B_rows)).squeeze(1)  # [n, H_out]
    y.index_add_(0, g.tok, delta.to(y.dtype))
