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
#   EXTRAS       the package's extras, comma-separated (ray, report, s3, hub); never dev
#   DEMO_DIR     when set, build the tiny demo bases and catalog there (`loraserve demo --tiny`;
#                a bare `loraserve serve` serves the SmolLM2 demo, whose model file images lack)
#   PIP_NO_CACHE_DIR=1 and the like pass through to pip as usual.
set -eu
SRC=${1:?usage: install.sh SRC VENV}
VENV=${2:?usage: install.sh SRC VENV}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
case ",${EXTRAS:-}," in
  *,dev,*) echo "install.sh: the dev extra (test tools) is not for images" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
if [ -n "${TORCH_INDEX:-}" ]; then
  $PIP install --quiet --index-url "$TORCH_INDEX" "$TORCH_SPEC"
else
  $PIP install --quiet "$TORCH_SPEC"
fi
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
  "$VENV/bin/loraserve" demo --tiny --dir "$DEMO_DIR" >/dev/null
fi
"$VENV/bin/loraserve" --help >/dev/null  # the entry point imports
