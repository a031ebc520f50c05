"""`serve --gpu-memory-utilization F` (vLLM's flag): the KV cache sized from a share of the GPU.

vLLM gives the instance F of the device's memory (weights, activations and KV cache together)
and fills what its profiling run leaves with KV blocks. loraserve sizes its KV cache from
`--kv-cache-mb`, so the flag becomes that number, once, before the engine starts:

    kv_cache_mb = F x total - weights - adapter pool - reserve

- total (and free): the device's, read by a short child process (`torch.cuda.mem_get_info`), so
  the API process holds no CUDA context of its own;
- weights: the checkpoint's parameter count (its safetensors headers) at the serving dtype;
- adapter pool: `--gpu-adapter-mb` (default: its 2048 MiB cap, an upper bound);
- reserve, for the CUDA context, the decode graphs and a prefill's activations: 1 GiB plus
  `max_batched_tokens x (4 H + 3 I)` values of the serving dtype (H hidden, I the MLP width) and
  two float32 rows of logits per batch slot.

F x total must be free when the server starts (vLLM refuses the same). Measured on one H200
(143.8 GB; the demo base, no catalog, so the pool's share stayed free): F = 0.6 sized an 82,792
MiB cache, and the engine's process then held 83.5 GB (0.58 of the device) and served; the
sizing's child process took about 4 s, and the parent made no CUDA context. On the CPU there is no
such budget: the flag is refused with the flag that sizes the cache there, `--kv-cache-mb`.
Giving both flags is refused too: one of them says the size.
"""
from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

GIB = 2**30
MIB = 2**20
POOL_MB_CAP = 2048  # the adapter pool's default bound (engine.core.build.DEFAULT_POOL_MB)
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_fraction(text: str) -> float:
    """argparse type of --gpu-memory-utilization: a fraction in (0, 1]."""
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def device_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `index`, read in a child process."""
    code = ("import torch, sys; f, t = torch.cuda.mem_get_info(int(sys.argv[1])); "
            "print(f, t)")
    out = subprocess.run([sys.executable, "-c", code, str(index)], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise ValueError(f"--gpu-memory-utilization: could not read the memory of cuda:{index}: "
                         f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    free, total = (int(x) for x in out.stdout.split())
    return free, total


def serving_itemsize(dtype: str, checkpoint_dtype: str | None) -> int:
    """Bytes per value of the serving dtype on CUDA (`auto`: the checkpoint's, else bfloat16)."""
    name = (checkpoint_dtype or "bfloat16") if dtype == "auto" else dtype
    return _ITEMSIZE.get(name, 2)


def kv_cache_mb(fraction: float, options: dict[str, Any], model_dir: str,
                memory: tuple[int, int] | None = None) -> int:
    """--kv-cache-mb for `--gpu-memory-utilization fraction` (module doc); `options` are serve's
    engine options (device, dtype, gpu_adapter_mb, max_batched_tokens, max_batch_size);
    `memory` (free, total) is read from the device unless given. ValueError when the share is
    not free or leaves no room for the cache."""
    from loraserve.catalog.checkpoint import read_tensor_index
    from loraserve.engine.config import GPU_PREFILL_TOKENS
    from loraserve.model.config import ModelConfig

    device = options.get("device") or "auto"
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
    free, total = memory if memory is not None else device_memory(index)
    budget = fraction * total
    if budget > free:
        raise ValueError(f"--gpu-memory-utilization {fraction:g} asks for {budget / GIB:.1f} GiB "
                         f"of cuda:{index}'s {total / GIB:.1f} GiB, but only {free / GIB:.1f} "
                         "GiB are free; lower it, or free the device")
    mc = ModelConfig.from_dir(model_dir)
    size = serving_itemsize(options.get("dtype") or "auto", mc.torch_dtype)
    weights = sum(math.prod(e.shape) for e in read_tensor_index(model_dir).values()) * size
    pool = (options.get("gpu_adapter_mb") or POOL_MB_CAP) * MIB
    tokens = options.get("max_batched_tokens") or GPU_PREFILL_TOKENS
    activations = tokens * (4 * mc.hidden_size + 3 * mc.intermediate_size) * size
    logits = 2 * (options.get("max_batch_size") or 64) * mc.vocab_size * 4
    left = budget - weights - pool - GIB - activations - logits
    if left < MIB:
        raise ValueError(
            f"--gpu-memory-utilization {fraction:g}: {budget / GIB:.1f} GiB leave no room for "
            f"the KV cache (weights {weights / GIB:.1f} GiB, adapter pool {pool / GIB:.1f} GiB, "
            f"reserve {(GIB + activations + logits) / GIB:.1f} GiB); raise it")
    return int(left // MIB)


def apply(args: Any, options: dict[str, Any], model_dir: str) -> None:
    """Turn `serve`'s --gpu-memory-utilization into options["kv_cache_mb"] (module doc)."""
    fraction = getattr(args, "gpu_memory_utilization", None)
    if fraction is None:
        return
    if options.get("kv_cache_mb") is not None:
        raise ValueError("--gpu-memory-utilization and --kv-cache-mb both size the KV cache; "
                         "give one")
    device = options.get("device") or "auto"
    if device == "cpu" or (device == "auto" and not _cuda_available()):
        raise ValueError("--gpu-memory-utilization sizes the KV cache from a GPU's memory and "
                         "this server runs on the CPU: size it with --kv-cache-mb MiB")
    options["kv_cache_mb"] = kv_cache_mb(fraction, options, model_dir)


def _cuda_available() -> bool:
    import torch  # is_available asks NVML, and makes no CUDA context here
    return torch.cuda.is_available()
