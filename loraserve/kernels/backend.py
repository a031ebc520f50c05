"""Backend choice for the LoRA ops: `triton` (CUDA, or CPU under TRITON_INTERPRET=1) or `torch`."""

from __future__ import annotations

import torch

from ._triton import interpreted, interpreter_enabled

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map a `--lora-backend` value to the backend that runs on `device`.

    "auto" -> "triton" on CUDA, "torch" elsewhere. "triton" on a non-CUDA device is allowed only
    under TRITON_INTERPRET=1, set before triton was imported (the slow interpreter, for tests);
    otherwise it is a clear error.
    """
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda":
        from .shrink import _shrink_kernel  # the kernels record how triton was imported

        if not (interpreter_enabled() and interpreted(_shrink_kernel)):
            raise ValueError(f"LoRA backend 'triton' needs a CUDA device (got {device.type}); "
                             "on CPU use 'torch' or 'auto', or set TRITON_INTERPRET=1 before "
                             "triton is imported to run the kernels in the (slow) interpreter")
    return name
