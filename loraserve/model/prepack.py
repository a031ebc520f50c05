"""The base's linear weights in oneDNN's blocked layout, for CPU serving.

`F.linear` on the CPU hands each call to a GEMM that re-packs the weight matrix into its blocked
layout first, every call. A decode step multiplies a few dozen rows by every weight of the
model, so it pays that packing (a read and a write of the whole weight) on each layer of each
step. `PackedLinear` packs once, at start-up (`torch.ops.mkldnn._reorder_linear_weight`, the op
torch's own compiler uses when it freezes CPU weights), and multiplies through oneDNN
(`_linear_pointwise`). Measured on the H 512 Qwen3 of the llama.cpp comparison, 2 threads:
a batch-32 decode step 1.3x faster, prefill unchanged (bench/RESULTS.md).

Results equal `F.linear`'s to float32 rounding (the two GEMMs sum in different orders), the way
two BLAS builds would. The packed copy replaces the plain weight, so memory does not grow, except
for a tied `lm_head`, whose embedding keeps its own plain copy (and the rest of the model moves
out of the checkpoint's file mapping into memory of its own, so the old pages go).

It pays only where the weights stream from memory. oneDNN spends ~12 µs more than `F.linear`
per call on small matrices, which a base whose linear weights fit in the last-level cache (the
3 MB demo base) never earns back: its 1-token requests took 1.26x the engine CPU packed.
`outgrows_last_level_cache` says which base to pack: one whose linear weights outgrow that
cache (bench/RESULTS.md).
"""
from __future__ import annotations

import collections
import itertools
import os
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.tracing import compiling
from ..kernels import cpu_gemv
from . import light_ops
from .quant import QuantLinear

DEFAULT_LLC_BYTES = 32 * 2**20  # when sysfs names no cache
# The most of the last-level cache a process counts on per CPU it may run on. A virtual machine
# reports its host socket's whole L3, shared with every other tenant's cores: a 2-vCPU Emerald
# Rapids guest sees 300 MiB, so SmolLM2's 270 MB of bfloat16 weights "fit", and the base ran on
# one thread with torch's GEMV, a third of the speed of the plain-weight path (32 against 11 ms a
# step). 8 MiB is above the per-core share of the server CPUs we know (Intel 1.9-5 MiB, AMD
# Zen 4 4 MiB), so a bare-metal figure is never cut below what a core really has.
PER_CPU_CACHE_BYTES = 8 * 2**20


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `prepack_linears` applies: float32 weights on a CPU with oneDNN, or bfloat16 ones
    where oneDNN has bfloat16 kernels (AVX512-BF16 or AMX: half the bytes a step reads)."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_kernels())


def bf16_kernels() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 GEMMs natively (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest data cache the kernel reports for cpu0 (the LLC), else DEFAULT_LLC_BYTES."""
    sizes = []
    for index in sysfs.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=DEFAULT_LLC_BYTES)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), at most OMP_NUM_THREADS when that is
    set: Ray sets it to an actor's CPU reservation, so engine replicas do not each take every core."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return max(1, min(cpus, int(omp)) if omp.isdigit() and int(omp) > 0 else cpus)


def cache_share_bytes(llc: int | None = None, cpus: int | None = None) -> int:
    """The last-level cache this process can count on: the LLC the kernel reports, at most
    PER_CPU_CACHE_BYTES for each CPU it may run on."""
    return min(llc or last_level_cache_bytes(), (cpus or usable_cpus()) * PER_CPU_CACHE_BYTES)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's `nn.Linear` weights, plain, packed or quantized (codes, scales, mins; a
    tied head counts again: it is packed or quantized too)."""
    plain = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    quantized = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantLinear)
                    for b in (m.codes, m.scales, m.mins))
    return plain + quantized + sum(m.in_features * m.out_features * m.packed.element_size()
                                   for m in model.modules() if isinstance(m, PackedLinear))


def outgrows_last_level_cache(model: nn.Module, cache_bytes: int | None = None) -> bool:
    """Whether the plain linear weights outgrow this process's share of the last-level cache
    (`cache_share_bytes`): then every GEMM streams its weight from memory, packing pays (module
    doc) and so does a second thread."""
    return linear_weight_bytes(model) > (cache_bytes or cache_share_bytes())


# A step of at most this many sequences reads plain weights faster: one row is a matrix-vector
# product, and `torch.mv` over the [out, in] weight streamed it 1.3x faster than oneDNN's GEMM
# over the packed layout at 0.6B shapes; from 4 rows on the packed layout wins (bench/RESULTS.md).
# The same holds in bfloat16 (bench/gemv_dtypes.py: mv 1.6x faster than packed at one row), so
# the rule does not depend on the dtype.
PLAIN_MAX_BATCH = 1


def weight_layout(setting: str, model: nn.Module, device: torch.device, dtype: torch.dtype,
                  max_batch: int, cache_bytes: int | None = None) -> str:
    """"packed" (oneDNN's layout, `prepack_linears`) or "plain" for `--weight-prepack` `setting`
    (auto | on | off). auto packs a base whose weights outgrow the last-level cache, unless no
    step can hold more than PLAIN_MAX_BATCH sequences, or `cpu_gemv` reads a plain weight once
    for a small batch of rows in this dtype (`cpu_gemv.reads_rows_once`: float32 on AVX-512,
    bfloat16 with AVX512-BF16):
    then one stream and a few read the weights at the memory's rate, which the packed GEMM does
    not at one row (bench/RESULTS.md, issue 41 part 2). One copy of the weights serves every
    batch size, so the layout follows the steps that read most bytes per token."""
    if setting == "off" or not can_prepack(device, dtype):
        return "plain"
    if setting == "on":
        return "packed"
    big = outgrows_last_level_cache(model, cache_bytes)
    few_rows = max_batch <= PLAIN_MAX_BATCH or cpu_gemv.reads_rows_once(dtype)
    return "packed" if big and not few_rows else "plain"


_HANDLES: dict[int, weakref.ref] = {}  # handle -> a live PackedLinear's packed weight
_next_handle = itertools.count()


def _register(packed: Tensor) -> int:
    """A handle compiled graphs name the packed weight by (the registry holds no reference)."""
    handle = next(_next_handle)
    _HANDLES[handle] = weakref.ref(packed, lambda _: _HANDLES.pop(handle, None))
    return handle


def packed_linear(x: Tensor, handle: int, out_features: int, bias: Tensor | None) -> Tensor:
    """`PackedLinear`'s GEMM as torch.compile sees it. The packed weight is an opaque oneDNN
    tensor, which dynamo cannot trace, so a graph carries its handle (a constant) instead and
    inductor calls this op as an extern kernel: a compiled step keeps the packed layout and the
    model keeps one copy of its weights (unpacking them for the graphs made a 0.6B-shaped base's
    steps 2.7x slower)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _HANDLES[handle](), bias, "none", [], "")


def _packed_linear_fake(x: Tensor, handle: int, out_features: int, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


light_ops.define("packed_linear", "(Tensor x, int handle, int out_features, Tensor? bias) -> Tensor",
                 packed_linear, _packed_linear_fake)


class PackedLinear(nn.Module):
    """An `nn.Linear` (no grad) whose weight lives in oneDNN's blocked layout. x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        # the layout is chosen for `batch_hint` rows; every other row count gives the same results
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
        self.handle = _register(self.packed)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """The plain [out, in] weight, unpacked (a copy: for inspection, not the hot path)."""
        return self.packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        if compiling():  # the graph calls the packed weight by its handle
            return torch.ops.loraserve.packed_linear(x, self.handle, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, layout=onednn"


# Dtypes whose one-row product runs fastest over a column-major weight (the [out, in] weight
# stored as [in, out]) where `cpu_gemv` is missing: MKL's float32 GEMM of one row by a contiguous
# [in, out] matrix streamed 0.6B shapes ~8% faster than `torch.mv` over [out, in]. Where
# `cpu_gemv` reads float32 rows (AVX-512), the weight stays row-major: its kernel for several
# rows reads that layout, and one row streams it 1.14x faster than the column-major kernel (SmolLM2
# shapes, bench/RESULTS.md issue 41). bfloat16 is row-major either way (column-major 2-3x slower).
COLUMN_MAJOR_DTYPES = (torch.float32,)


class VectorLinear(nn.Linear):
    """An `nn.Linear` in a plain layout for one sequence at a time, its weight laid out the way
    its dtype's one-row kernel streams fastest (`vector_linears`): column-major float32, or
    row-major bfloat16. A one-row call goes to `cpu_gemv.vec_linear` where this CPU has its
    kernel (`native`: AVX-512, and AVX512-BF16 for bfloat16), else to torch (the GEMM
    `x @ [in, out]` for float32, `torch.mv` for bfloat16); several rows, or a call that needs
    gradients, to `F.linear`. The weight's shape is [out, in] either way, so whatever reads it
    (LoRA shapes, training hooks through `F.linear`) sees an ordinary linear."""

    native = False  # calls through cpu_gemv (set by `vector_linears`)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if x.dim() != 2 or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
        if self.native and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            y = cpu_gemv.vec_linear(x, w)  # any row count: the kernel picks (cpu_gemv.vec_linear)
            return y if self.bias is None else y + self.bias
        if x.shape[0] != 1:
            return F.linear(x, w, self.bias)
        if not w.is_contiguous():
            return F.linear(x, w, self.bias)
        y = torch.mv(w, x[0])
        return (y if self.bias is None else y + self.bias).unsqueeze(0)


@torch.no_grad()
def vector_linears(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of model a `VectorLinear`, in place; returns how many. A
    weight of a `COLUMN_MAJOR_DTYPES` dtype is copied column-major (once; the copy replaces it),
    unless another module shares it (a tied head keeps its embedding's layout), and the rest of
    the model then moves out of the checkpoint's file mapping as `prepack_linears` does. For
    plain-layout serving: after loading and fusing, before LoRA wrappers."""
    shared = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    count, moved = 0, set()
    for module in model.modules():
        for child in module.children():
            if type(child) is not nn.Linear:
                continue
            child.__class__ = VectorLinear
            count += 1
            w = child.weight
            column = w.dtype in COLUMN_MAJOR_DTYPES and not cpu_gemv.reads_rows_once(w.dtype)
            if column and shared[id(w)] == 1 and w.is_contiguous():
                child.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=w.requires_grad)
                moved.add(id(child.weight))
            child.native = _native_one_row(child.weight)
    if moved:
        _own_the_rest(model, skip=moved)
    return count


def _native_one_row(w: Tensor) -> bool:
    """Whether `cpu_gemv` has a kernel for this weight: on the CPU, in a dtype this CPU's build
    serves, row-major (or column-major float32)."""
    if w.device.type != "cpu" or not cpu_gemv.supports(w.dtype):
        return False
    row = w.stride(1) == 1 and w.stride(0) == w.shape[1]
    col = w.stride(0) == 1 and w.stride(1) == w.shape[0]
    return row or (col and w.dtype == torch.float32)


def prepack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every plain `nn.Linear` in model by a `PackedLinear`, in place; returns how many.
    Call it after the weights are loaded (and tied) and before LoRA wrappers go on."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, batch_hint))
    if swaps:
        _own_the_rest(model)
    return len(swaps)


@torch.no_grad()
def _own_the_rest(model: nn.Module, skip: set[int] = frozenset()) -> None:
    """Copy the tensors left plain (embedding, norms, experts) into memory of their own. The
    loader's tensors are views of the checkpoint's file mapping, which stays mapped while any of
    them lives, and packing has just read every page of it: without this the process would hold
    the old weights' pages as well as the packed copies (H 512 base: 441 against 345 MiB RSS)."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in skip:  # already a copy of its own
                param.data = param.data.clone()
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, buf.clone())


def unpack_linears(model: nn.Module) -> int:
    """Undo `prepack_linears` (LoRA wrappers included): plain `nn.Linear`s with the same weights,
    for code that needs plain modules (compiled steps do not: `packed_linear`); returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, PackedLinear)]
    for parent, name, child in swaps:
        plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                          device="meta")
        plain.weight = nn.Parameter(child.weight, requires_grad=False)
        plain.bias = child.bias
        setattr(parent, name, plain)
    return len(swaps)
