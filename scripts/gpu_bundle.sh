#!/usr/bin/env bash
# Pack what scripts/gpu_check.sh borrows on a bare GPU image into one ignored folder, small
# enough to carry to the device machine (its carry limit is 64 MiB and 8 paths; .venv is far
# bigger): the pure-Python test packages (pytest, hypothesis and what they import) from the
# local .venv, without bytecode. The demo base is carried as .loraserve (about 11 MiB).
#   bash scripts/gpu_bundle.sh     # then: carry [".gpu_bundle", ".loraserve", ".whl"], run gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m loraserve.cli demo >/dev/null   # builds .loraserve/demo once (idempotent)
OUT=.gpu_bundle/site
rm -rf .gpu_bundle
mkdir -p "$OUT"
for site in .venv/lib/python3*/site-packages; do
  for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py hypothesis \
             _hypothesis_globals.py _hypothesis_ftz_detector.py _hypothesis_pytestplugin.py \
             sortedcontainers; do
    for hit in "$site/$pkg" "$site/$pkg"-*.dist-info; do
      if [ -e "$hit" ]; then cp -r "$hit" "$OUT/"; fi
    done
  done
done
# Compiled packages the GPU image lacks (its python is 3.12), as wheels for gpu_check.sh.
rm -rf .whl; mkdir -p .whl
for req in $("$PY" -c "import lmdb, orjson, xxhash; print(f'lmdb=={lmdb.__version__} orjson=={orjson.__version__} xxhash=={xxhash.VERSION}')"); do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$req"
done
find .gpu_bundle -name __pycache__ -prune -exec rm -rf {} +
du -sh .gpu_bundle .loraserve .whl
