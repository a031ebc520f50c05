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
ACTIVATION_PTRS = {"x_ptr", "a0_ptr", "a1_ptr", "a2_ptr", "y0_ptr", "y1_ptr", "y2_ptr",
                   "b0_ptr", "b1_ptr", "b2_ptr"}


def _arg_type(name: str, dtype: str) -> str:
    """Activations and pools in `dtype`, the rank-space buffer float32, metadata int32."""
    if name in ACTIVATION_PTRS:
        return f"*{dtype}"
    if name == "v_ptr":
        return "*fp32"
    return "*i32" if name.endswith("_ptr") else "i32"


def _compile(kernel, dtype: str, constexprs: dict[str, object]) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs else _arg_type(n, dtype)
                 for n in kernel.arg_names}
    src = ASTSource(kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def compile_all() -> int:
    """Compile shrink (split-K off/on) and expand for bf16, fp16 and fp32; return the count."""
    from loraserve.kernels.expand import _expand_kernel
    from loraserve.kernels.shrink import _shrink_kernel

    count = 0
    for dtype in ("bf16", "fp16", "fp32"):
        precision = "ieee" if dtype == "fp32" else "tf32"
        for split, bk in ((1, 64), (16, 128)):
            assert _compile(_shrink_kernel, dtype, dict(BLOCK_T=16, BLOCK_R=16, BLOCK_K=bk,
                                                        SPLIT_K=split, UPCAST=False,
                                                        PRECISION=precision))
            count += 1
        for bt, bn in ((16, 128), (64, 64)):
            assert _compile(_expand_kernel, dtype, dict(BLOCK_T=bt, BLOCK_R=16, BLOCK_N=bn,
                                                        UPCAST=False, PRECISION=precision))
            count += 1
    return count


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO),
               TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "compiled 12 kernels for sm_90"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(f"compiled {compile_all()} kernels for sm_90")
