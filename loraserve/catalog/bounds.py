"""What an adapter's factors can do to the numbers they touch: the one check every entry makes.

A LoRA target adds `B @ (A @ x)` to a module's output. Over any input, the largest value that
delta can take is bounded through the factors' infinity norms (largest absolute row sum), with
B's rows (r values each, r the rank) bounded by r times B's largest value:

    max|B A x| <= ||B||_inf * ||A||_inf * max|x| <= gain * max|x|,   gain = r * max|B| * ||A||_inf

(per expert for packed MoE factors; the adapter's gain is the largest of its targets'). B's side
is at most r times looser than its exact norm, and costs one maximum per factor instead of a
sum per row: a B factor has one row per output feature, a few thousand rows of a few values
each, and summing those row by row cost more than the rest of a page-in's decode. NaN or
Inf in a factor makes the gain NaN or Inf, so one number answers both "is it finite" and "can it
overflow". A revision is servable in a compute dtype when its gain stays under that dtype's
limit (`GAIN_LIMITS`):

- float32 and bfloat16 (8 exponent bits): an input of 1e4, beyond any hidden-state outlier of
  the model families served, times a gain of 1e12 stays below 1e16, whose square (RMSNorm squares
  the residual stream) summed over a hidden size up to 1e6 still fits in float32 (3.4e38).
- float16: an input of 64 times a gain of 1e3 stays a factor of two below float16's largest value.

The bound is per target. Targets compose (v_proj's delta feeds o_proj's), so a revision under
the limit can still drive a sequence to Inf at run time; that sequence fails alone and its
revision is quarantined (`loraserve.engine.core.llm_engine.LLMEngine._screen`).

Ordinary adapters have gains of 0.01-100; `catalog audit` used to find the rest (`error inf`)
only after they were served. Export and import (`save_revision`, every writer's path), a runtime
load, and every page-in (`layout.load_revision(..., compute_dtype=...)`) run this same check, so
a revision refused at one entry is refused at all of them.

numpy, not torch: page-ins decode on the engine thread between steps and pager threads must not
start OpenMP teams of their own (see `layout._all_finite`).
"""
from __future__ import annotations

import numpy as np

from .errors import FactorsTooLarge, NonFiniteWeights
from .targets import module_path, parse_tensor_name, tensor_names

GAIN_LIMITS = {"float32": 1e12, "bfloat16": 1e12, "float16": 1e3}


def gain_limit(*dtypes: str) -> float:
    """The limit for factors stored in one dtype and computed in another: the narrower's."""
    return min(GAIN_LIMITS[d] for d in dtypes)


def as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of an array holding `dtype` (bfloat16 arrives as its raw uint16 bits)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


def tensor_array(t) -> tuple[np.ndarray, str]:
    """A torch tensor as a numpy array numpy can read (bfloat16 as its bits) and its dtype name."""
    name = str(t.dtype).removeprefix("torch.")
    t = t.detach().cpu().contiguous()
    if name == "bfloat16":
        import torch  # the catalog's torch-free modules import this one; torch only when asked

        return t.view(torch.int16).numpy().view(np.uint16), name
    return t.numpy(), name


def pair_gain(a: np.ndarray, b: np.ndarray) -> float:
    """Gain of one target: A [.., r, in], B [.., out, r] as float32 arrays (a leading expert axis
    or none). float64 sums: a gain past float32's range is still a finite number to report."""
    ga = np.abs(a).sum(axis=-1, dtype=np.float64).max(axis=-1)
    gb = a.shape[-2] * np.abs(b).reshape(*b.shape[:-2], -1).max(axis=-1).astype(np.float64)
    return float(np.max(ga * gb))


def target_gains(tensors: dict) -> dict[str, float]:
    """module path -> gain, for serving-layout tensors (torch tensors, name -> factor)."""
    gains = {}
    for name in tensors:
        kind, layer, is_a = parse_tensor_name(name)
        if not is_a:
            continue
        a_name, b_name = tensor_names(kind, layer)
        (a, dtype), (b, _) = tensor_array(tensors[a_name]), tensor_array(tensors[b_name])
        gains[module_path(kind, layer)] = pair_gain(as_float32(a, dtype), as_float32(b, dtype))
    return gains


def check_gain(path: str, gain: float, limit: float, dtype: str, what: str = "") -> None:
    """NonFiniteWeights for a NaN/Inf gain, FactorsTooLarge for one over `limit`; both name `path`."""
    if gain <= limit:
        return
    if not np.isfinite(gain):
        raise NonFiniteWeights(f"{path}: factors hold NaN or Inf values{what}; non-finite weights are never served")
    raise FactorsTooLarge(
        f"{path}: the LoRA factors can scale an activation by {gain:.3g} (||B||*||A||), beyond the "
        f"{limit:.0g} that {dtype} serving allows{what}; such a revision can overflow and is never served")


def check_servable(tensors: dict, dtype: str, compute_dtype: str | None = None, what: str = "") -> None:
    """Refuse serving-layout `tensors` (stored in `dtype`) whose factors can overflow `dtype` or
    the engine's `compute_dtype`: NonFiniteWeights / FactorsTooLarge (400) naming the target."""
    limit = gain_limit(dtype, compute_dtype or dtype)
    shown = compute_dtype if compute_dtype and GAIN_LIMITS[compute_dtype] < GAIN_LIMITS[dtype] else dtype
    for path, gain in target_gains(tensors).items():
        check_gain(path, gain, limit, shown, what)


class GainPlan:
    """The gain check of one tensor table, on the blob's flat data region in a few numpy calls.

    A page-in sees a handful of tensor tables across a million revisions (`layout._LAYOUTS`), and
    one numpy call per tensor costs more than a small adapter's whole decode: so the table is cut
    once into segments, in offset order (one per row of each A factor, one per expert of each B
    factor), and a blob's check is |x| once, one `add.reduceat` and one `maximum.reduceat` over
    those segments, and a product of two gathers. `gain(flat)` equals the largest of
    `target_gains` (a property test holds them to it)."""

    __slots__ = ("starts", "a_rows", "b_groups", "rank", "row")

    def __init__(self, tensors: list[tuple[str, tuple[int, ...], int]]) -> None:
        """`tensors`: (name, shape, element offset in the flat region), tiling it exactly."""
        starts, first = [], {}  # segment starts; tensor name -> index of its first segment
        seen = 0
        for name, shape, offset in sorted(tensors, key=lambda t: t[2]):
            is_a = parse_tensor_name(name)[2]
            per = shape[-1] if is_a else shape[-2] * shape[-1]  # a row of A; an expert's B
            count = int(np.prod(shape)) // per
            first[name] = seen
            starts.append(offset + np.arange(count, dtype=np.intp) * per)
            seen += count
        a_rows, b_groups, rank, row = [], [], 0, 0
        for name, shape, _ in tensors:
            kind, layer, is_a = parse_tensor_name(name)
            if is_a:
                rank, experts, row = shape[-2], int(np.prod(shape[:-2])), max(row, shape[-1])
                a_rows.append(first[name] + np.arange(experts * rank, dtype=np.intp))
                b_groups.append(first[tensor_names(kind, layer)[1]] + np.arange(experts, dtype=np.intp))
        self.starts = np.concatenate(starts)
        self.a_rows = np.concatenate(a_rows)      # [groups * rank]: A's row segments, group-major
        self.b_groups = np.concatenate(b_groups)  # [groups]: the paired B segment of each group
        self.rank = rank
        self.row = row  # the longest row of an A factor

    def gain(self, flat: np.ndarray, limit: float | None = None) -> float:
        """The adapter's gain from its flat data region (float32 values, in offset order).

        With `limit`, the row sums are first taken in float32 (a third of the float64 sums'
        cost, which were most of a large adapter's decode): a gain found under half the limit
        is returned as is, since the exact one is under the limit too (a float32 sum of n
        non-negative values is off by at most n * 2**-24 of itself, under a half for rows
        shorter than 2**23); any other (near or over the limit, NaN, a float32 overflow) is
        taken again in float64. So a check against `limit` accepts and refuses exactly what
        the float64 one does."""
        x = np.abs(flat)
        if limit is not None and self.row < 2**23:
            fast = self._gain(x, np.float32)
            if fast <= limit / 2:  # NaN compares False
                return fast
        return self._gain(x, np.float64)

    def _gain(self, x: np.ndarray, dtype) -> float:
        """The gain of |flat| with the rows of A summed in `dtype`."""
        with np.errstate(over="ignore"):
            sums = np.add.reduceat(x, self.starts, dtype=dtype)
        ga = sums[self.a_rows].reshape(-1, self.rank).max(axis=1).astype(np.float64)
        gb = self.rank * np.maximum.reduceat(x, self.starts)[self.b_groups].astype(np.float64)
        return float(np.max(ga * gb))
