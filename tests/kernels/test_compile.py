"""The Triton kernels compile for an H200 (sm_90) even on a machine without a GPU.

The interpreter runs the kernels' semantics on CPU; this ahead-of-time compile catches what only
the real compiler rejects (types, block shapes, dot constraints) for every dtype and split-K mode.
It runs in a subprocess because Triton cannot compile in a process where TRITON_INTERPRET=1 was
set when it was imported. Run directly (`python tests/kernels/test_compile.py`) it compiles all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACTIVATION_PTRS = {"x_ptr", "a_ptr", "y_ptr", "b_ptr"}


def _arg_type(name: str, dtype: str) -> str:
    """Activations and pools in `dtype`, the rank-space buffer float32, metadata int32."""
    if name in ACTIVATION_PTRS:
        return f"*{dtype}"
    if name == "v_ptr":
        return "*fp32"
    return "*i32" if name.endswith("_ptr") else "i32"


def _compile(kernel, dtype: str, constexprs: dict[str, object], num_warps: int) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs else _arg_type(n, dtype)
                 for n in kernel.arg_names}
    src = ASTSource(kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["cubin"]


# (op, T, H, S_max) whose picked launches cover both shrink modes (decode: BLOCK_K 128 with 16
# K splits; prefill: BLOCK_K 64, no split) and both expand tiles (16 x 128 and 64 x 64).
SHAPES = (("shrink", 2000, 1000, 200), ("shrink", 8, 4096, 8),
          ("expand", 8, 1024, 8), ("expand", 2000, 512, 1))


def compile_all() -> int:
    """Compile shrink (split-K off/on) and expand for bf16, fp16 and fp32, each with the
    constexprs `LaunchConfig.pick` chooses on CUDA; return the count."""
    import torch

    from loraserve.kernels.expand import _expand_kernel
    from loraserve.kernels.launch import LaunchConfig
    from loraserve.kernels.shrink import _shrink_kernel

    kernels = {"shrink": _shrink_kernel, "expand": _expand_kernel}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    count = 0
    for dtype, torch_dtype in dtypes.items():
        for op, t, h, s_max in SHAPES:
            cfg = LaunchConfig.pick(op, num_tokens=t, hidden=h, r_max=64, max_segments=s_max,
                                    dtype=torch_dtype, device="cuda")
            assert _compile(kernels[op], dtype, cfg.constexprs(), cfg.num_warps)
            count += 1
    return count


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the caller's path first (scripts/gpu_check.sh links the installed package shape there)
    path = [p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p]
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(path),
               TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "compiled 12 kernels for sm_90"


if __name__ == "__main__":
    sys.path.append(str(REPO))
    print(f"compiled {compile_all()} kernels for sm_90")
