#!/usr/bin/env bash
# GPU check for one CUDA machine (built for an H200): kernel tests on CUDA, then the kernel
# benchmark, then a summary table. Needs torch + triton already installed; no network; never
# installs torch. Runs from any directory; about 3-6 minutes (hard limits below keep it < 10).
#   bash scripts/gpu_check.sh              # logs land in ${GPU_CHECK_OUT:-$OUT or /tmp}/gpu_check
# On the device machine: first `bash scripts/gpu_bundle.sh` here, then carry
# [".gpu_bundle", ".loraserve", ".whl"] (test packages, the demo base, wheels) with the run.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
LOG=${GPU_CHECK_OUT:-${OUT:-/tmp}}/gpu_check
mkdir -p "$LOG"
unset TRITON_INTERPRET            # compiled kernels, never the interpreter
# The source tree installs as one package, loraserve/. A bare GPU image has no install, so a
# folder holding only a link to it gives Python that package without putting the repository's
# root (tests/, bench/, scripts/, ...) on the path.
PKG=/tmp/loraserve_pkg
rm -rf "$PKG"; mkdir -p "$PKG"
ln -s "$REPO/loraserve" "$PKG/loraserve"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
# Wheels carried in .whl (packages the image lacks, e.g. lmdb) go to their own folder.
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/loraserve_site "$REPO"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/loraserve_site"
fi
export TRITON_DEFAULT_FP_FUSION=1

# A python whose torch sees CUDA: $PYTHON, then python3/python (the local .venv is a CPU build).
PY=""
for cand in ${PYTHON:-} python3 python; do
  if command -v "$cand" >/dev/null && "$cand" -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=$cand; break
  fi
done
if [ -z "$PY" ]; then echo "gpu_check: no python with CUDA torch + triton found" >&2; exit 2; fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$LOG/env.txt"

# pytest / hypothesis may be missing on a bare GPU image: borrow the pure-Python test packages
# (and their dist-info, so plugins register) from a carried .gpu_bundle (scripts/gpu_bundle.sh)
# or .venv, appended after site-packages.
if [ -d "$REPO/.gpu_bundle/site" ] && ! "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$REPO/.gpu_bundle/site"
fi
if ! "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  SHIM="$LOG/pytest_shim"; mkdir -p "$SHIM"
  for site in "$REPO"/.venv/lib/python3*/site-packages; do
    for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py hypothesis \
               _hypothesis_globals.py _hypothesis_ftz_detector.py _hypothesis_pytestplugin.py \
               sortedcontainers; do
      for hit in "$site/$pkg" "$site/$pkg"-*.dist-info; do
        [ -e "$hit" ] && ln -sfn "$hit" "$SHIM/$(basename "$hit")"
      done
    done
  done
  export PYTHONPATH="$PYTHONPATH:$SHIM"
fi

status_tests="not run"
if "$PY" -c "import pytest" 2>/dev/null; then
  # --confcutdir: only tests/kernels' own conftest (the root one imports the whole server).
  # -P and --import-mode=append: the linked package above, not the bare source folder in the cwd.
  timeout 120 "$PY" -P -m pytest -q -rfE -p no:cacheprovider --import-mode=append --confcutdir=tests/kernels tests/kernels \
    2>&1 | tee "$LOG/kernel_tests.txt"
  rc=${PIPESTATUS[0]}
  status_tests="$(tail -n 1 "$LOG/kernel_tests.txt") (rc=$rc)"
else
  echo "gpu_check: pytest unavailable, kernel tests skipped" | tee "$LOG/kernel_tests.txt"
fi

timeout 120 "$PY" bench/kernels.py 2>&1 | tee "$LOG/bench_kernels.txt"
status_bench="rc=${PIPESTATUS[0]}"

# ---- decode benchmarks (engine on CUDA; need safetensors, tokenizers, jinja2, lmdb, xxhash) ----
status_decode="not run (missing python packages)"
if "$PY" -c "import safetensors, tokenizers, jinja2, lmdb, xxhash, numpy" 2>/dev/null; then
  # eager against the compiled decode step (CUDA graphs), interleaved; LoRA: outputs checked first
  timeout 120 "$PY" bench/decode.py --device cuda --tokens 64 --compile both 2>&1 | tee "$LOG/bench_decode.txt"
  status_decode="base rc=${PIPESTATUS[0]}"
  if "$PY" -c "import peft, transformers" 2>/dev/null; then
    timeout 150 "$PY" bench/lora_decode.py --device cuda --no-peft --compile both 2>&1 | tee "$LOG/bench_lora_decode.txt"
    status_decode="$status_decode, lora rc=${PIPESTATUS[0]}"
    if "$PY" -c "import pytest" 2>/dev/null; then  # compiled == eager, and == PEFT, on CUDA
      timeout 150 "$PY" -P -m pytest -q -rfE -p no:cacheprovider --import-mode=append \
        tests/lora/test_compiled_decode.py 2>&1 | tee "$LOG/compiled_decode_tests.txt"
      status_decode="$status_decode, compiled-decode tests: $(tail -n 1 "$LOG/compiled_decode_tests.txt")"
    fi
  fi
fi
# ---- end decode benchmark ----

# real model shapes (SmolLM2-135M, Qwen3-0.6B; random weights) in bf16: eager against CUDA-graph
# replay at batch 1, 8, 32 and 32 mixed adapters, each as a fraction of the weight-read floor
status_shapes="not run (missing python packages)"
if "$PY" -c "import safetensors, tokenizers, lmdb, xxhash, numpy, tqdm" 2>/dev/null; then
  timeout 240 "$PY" bench/gpu_shapes.py --device cuda --dtype bfloat16 2>&1 | tee "$LOG/bench_gpu_shapes.txt"
  status_shapes="rc=${PIPESTATUS[0]}"
fi

# packed vs per-expert MoE LoRA loading into the device row pool (issue 4's >= 10x is a GPU effect)
status_moe="not run (missing python packages)"
if "$PY" -c "import safetensors, lmdb, xxhash" 2>/dev/null; then
  timeout 60 "$PY" bench/catalog.py moe --device cuda 2>&1 | tee "$LOG/bench_moe_load.txt"
  status_moe="rc=${PIPESTATUS[0]}"
fi

# the cold path on CUDA (issue 29): page-ins decoded into pinned CPU-tier slabs, copied into the
# device pool on its side stream; cold adapters/s against the floor set by the bytes over the
# measured pinned host-to-device bandwidth, and the share of the copies hidden under compute
status_cold="not run (missing python packages)"
if "$PY" -c "import safetensors, lmdb, xxhash, numpy, orjson" 2>/dev/null; then
  timeout 120 "$PY" bench/pool_load.py --device cuda --rounds 3 2>&1 | tee "$LOG/bench_pool_load.txt"
  status_cold="rc=${PIPESTATUS[0]}"
fi

echo
echo "================ gpu_check summary ================"
cat "$LOG/env.txt"
echo "kernel tests : $status_tests"
echo "kernel bench : $status_bench"
echo "decode bench : $status_decode"
echo "moe loading  : $status_moe"
echo "cold path    : $status_cold"
echo "model shapes : $status_shapes"
grep -E '^#|^ *[0-9T-]' "$LOG/bench_kernels.txt" || true
cat "$LOG"/bench_decode.txt "$LOG"/bench_lora_decode.txt 2>/dev/null | grep -E 'tok/s|^ +[0-9]|adapters|base only|^#|equal' || true
tail -n 4 "$LOG/bench_moe_load.txt" 2>/dev/null || true
grep -E '^\||bandwidth' "$LOG/bench_pool_load.txt" 2>/dev/null || true
grep -E '^\||^# device' "$LOG/bench_gpu_shapes.txt" 2>/dev/null || true
