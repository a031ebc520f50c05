#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-perplexity` (CPU only, Release) from the llama.cpp sources bundled in
# llama-cpp-python's source package on PyPI, and a separate venv for its converters
# (convert_hf_to_gguf.py, convert_lora_to_gguf.py). Idempotent: every step is skipped when its
# output exists. Nothing is written inside the repository except under the cache dir
# (default .loraserve/llamacpp, git-ignored).
#
#   bash bench/llamacpp/build.sh            # or LLAMACPP_CACHE=/tmp/llamacpp bash ...
#
# Env: LLAMACPP_CACHE (cache dir), LLAMA_CPP_PYTHON_VERSION (default 0.3.36),
#      JOBS (default 2), TORCH_SPEC (default torch==2.13.0, the local CPU build),
#      LLAMACPP_BUILD (build dir, default $LLAMACPP_CACHE/build), LLAMACPP_CFLAGS (extra C/C++
#      flags: on a 2-vCPU Emerald Rapids guest the AMX path killed llama-server with SIGILL on a
#      Q4_1 file, so LLAMACPP_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" builds it without).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${LLAMACPP_CACHE:-$ROOT/.loraserve/llamacpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
mkdir -p "$CACHE"
SRC="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp"

# 1. sources
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    "$ROOT/.venv/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
# the llama.cpp commit this release vendors (the sdist carries the submodule's git HEAD; its
# CHANGELOG names the same commit, abbreviated)
SUBMODULE_HEAD="$CACHE/llama_cpp_python-$VERSION/.git/modules/vendor/llama.cpp/HEAD"
if [ -f "$SUBMODULE_HEAD" ]; then
    echo "ggml-org/llama.cpp@$(cat "$SUBMODULE_HEAD")" > "$CACHE/LLAMACPP_COMMIT"
else
    grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$CACHE/llama_cpp_python-$VERSION/CHANGELOG.md" \
        > "$CACHE/LLAMACPP_COMMIT" || echo unknown > "$CACHE/LLAMACPP_COMMIT"
fi

# 2. llama-server and llama-perplexity (CPU only, no network features: no OpenSSL, no prebuilt
#    web UI download)
BUILD="${LLAMACPP_BUILD:-$CACHE/build}"
CFLAGS_EXTRA="${LLAMACPP_CFLAGS:-}"
if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-perplexity" ]; then
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_C_FLAGS="$CFLAGS_EXTRA" -DCMAKE_CXX_FLAGS="$CFLAGS_EXTRA"
    cmake --build "$BUILD" --target llama-server llama-perplexity -j "$JOBS"
fi
"$BUILD/bin/llama-server" --version 2>&1 | tail -n 2 > "$CACHE/LLAMACPP_VERSION" || true

# 3. converter venv (separate from the project's .venv)
VENV="$CACHE/venv"
if [ ! -f "$VENV/.ready" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "$TORCH_SPEC"
    # the converters' pins (requirements/requirements-convert_*.txt; torch is the local CPU
    # build instead of their 2.11; sentencepiece 0.2.0, since 0.2.1+ needs protobuf 5), plus
    # peft, which writes the adapters
    "$VENV/bin/pip" install -q "$SRC/gguf-py" "numpy~=2.2.6" "sentencepiece==0.2.0" \
        "transformers==4.57.6" "protobuf>=4.21.0,<5.0.0" safetensors "peft==0.21.2"
    touch "$VENV/.ready"
fi
echo "llama.cpp: $(cat "$CACHE/LLAMACPP_COMMIT")  ($(cat "$CACHE/LLAMACPP_VERSION" | tr '\n' ' '))"
echo "llama-server: $BUILD/bin/llama-server"
echo "converter venv: $VENV"
