"""Synthetic adapter blobs, fast: one safetensors template per (base, rank, targets, dtype), new data per id.

The template header is written once by safetensors itself; since every synthetic adapter of a
run has the same tensor names and shapes, only the data bytes differ. Each adapter's data is
drawn from a generator seeded by (seed, xxh3_64(adapter_id)), so an id always gets the same
bytes for a given seed, whichever worker or rerun builds it. Torch-free (numpy only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import safetensors.numpy
import xxhash

from .dtypes import serving_dtype
from .format import FORMAT, canonical_blob, read_header
from .targets import parse_module_path, parse_tensor_name, tensor_names

B_STD = 0.02  # std of synthetic B entries; A entries have std 1/sqrt(in)


@dataclass(slots=True)
class BlobTemplate:
    """The shared header of a synthetic run plus a per-element scale for the data region."""

    header: bytes  # the blob's first bytes: length prefix + JSON header
    scale: np.ndarray  # [N] float32, std of each data element (A: 1/sqrt(in), B: B_STD)
    dtype: str  # a serving dtype name (catalog.dtypes)

    def blobs(self, adapter_ids: list[str], seed: int) -> list[bytes]:
        """Blobs of a batch of synthetic adapters, built together (each still a function of its id and seed)."""
        keys = np.fromiter((xxhash.xxh3_64_intdigest(a.encode(), seed) for a in adapter_ids), np.uint64, len(adapter_ids))
        data = uniform_std1(keys, self.scale.shape[0])  # [B, N]
        data *= self.scale
        rows = encode(data, self.dtype)
        width = len(rows) // max(len(adapter_ids), 1)
        return [self.header + rows[i * width : (i + 1) * width] for i in range(len(adapter_ids))]

    def blob(self, adapter_id: str, seed: int) -> bytes:
        """The blob of one synthetic adapter (same bytes as in any batch)."""
        return self.blobs([adapter_id], seed)[0]


def uniform_std1(keys: np.ndarray, n: int) -> np.ndarray:
    """[len(keys), n] float32, uniform with mean 0 and std 1; element j of row b = splitmix64(keys[b], j).

    A counter-based generator, vectorized over the batch: ~100x cheaper than one seeded numpy
    Generator per adapter, and the values of an id never depend on its batch neighbours.
    """
    with np.errstate(over="ignore"):
        x = keys[:, None] + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[None, :]
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    u = (x >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1)
    return (u - np.float32(0.5)) * np.float32(12.0**0.5)


def encode(data: np.ndarray, dtype: str) -> bytes:
    """float32 values -> little-endian bytes of the serving dtype (bfloat16 rounded to nearest even)."""
    if dtype == "float32":
        return data.tobytes()
    if dtype == "float16":
        return data.astype(np.float16).tobytes()
    bits = data.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def synthetic_shapes(modules: dict[str, tuple[int, int, int]], rank: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for `modules` (path -> (in, out, experts)) at `rank`."""
    shapes = {}
    for path, (fan_in, fan_out, experts) in modules.items():
        lead = (experts,) if experts else ()
        a_name, b_name = tensor_names(*parse_module_path(path))
        shapes[a_name] = (*lead, rank, fan_in)
        shapes[b_name] = (*lead, fan_out, rank)
    return shapes


def build_template(
    modules: dict[str, tuple[int, int, int]], rank: int, targets: list[str], dtype: str, fingerprint: str
) -> BlobTemplate:
    """Write a zero blob with safetensors once and keep its header and per-element scales."""
    d = serving_dtype(dtype)
    shapes = synthetic_shapes(modules, rank)
    meta = {"format": FORMAT, "base_fingerprint": fingerprint, "rank": str(rank),
            "targets": ",".join(targets), "dtype": dtype, "source": "synthetic"}
    # numpy has no bfloat16: write unsigned ints of the element size and patch in the dtype code
    zeros = {name: np.zeros(shape, dtype=f"<u{d.itemsize}") for name, shape in shapes.items()}
    blob = canonical_blob(safetensors.numpy.save(zeros, metadata=meta), d.st_code)
    entries, _, offset = read_header(blob)
    scale = np.empty((len(blob) - offset) // d.itemsize, dtype=np.float32)
    for name, e in entries.items():
        lo, hi = (o // d.itemsize for o in e["data_offsets"])
        fan_in = shapes[name][-1]
        scale[lo:hi] = fan_in ** -0.5 if parse_tensor_name(name)[2] else B_STD
    return BlobTemplate(blob[:offset], scale, dtype)


def target_modules(base_modules: dict, kinds: list[str]) -> dict[str, tuple[int, int, int]]:
    """The base's module paths for `kinds`: path -> (in, out, experts); ValueError if a kind is absent."""
    out = {}
    for kind in kinds:
        paths = [p for p in base_modules if parse_module_path(p)[0] == kind]
        if not paths:
            raise ValueError(f"base has no {kind!r} modules")
        for p in paths:
            m = base_modules[p]
            out[p] = (m.in_features, m.out_features, m.experts)
    return out
