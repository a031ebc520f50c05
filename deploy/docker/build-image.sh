#!/bin/sh
# Build the CPU image (deploy/docker/Dockerfile.cpu, DEMO=1) with no daemon and no container
# registry: `make image` runs this, then deploy/docker/smoke.py (the image answers a completion).
#
#   deploy/docker/build-image.sh [TAG]         default TAG: localhost/loraserve:cpu-demo
#
# 1. The base: a Debian bookworm root file system (python3, python3-venv, ca-certificates) made
#    by mmdebstrap from Debian's packages, imported as localhost/loraserve-base:bookworm
#    (the Dockerfile's PYTHON_IMAGE); made once, kept in containers-storage.
# 2. The image: buildah builds the Dockerfile from `git archive HEAD` (the committed tree, not
#    whatever else lies in the working tree), pip taking wheels from PyPI, torch from
#    $TORCH_FIND_LINKS when that folder exists (mounted read-only into the build), with pip's
#    CA bundle ($PIP_CERT, mounted) where egress goes through a proxy with its own CA.
#
# Needs root (or a user with subuids), and the Debian packages mmdebstrap, buildah, podman,
# runc (apt-get install -y mmdebstrap buildah podman runc uidmap). On hosts like this one:
#   - runc, not crun: Debian 12's crun refuses a cgroup v1/v2 "hybrid" host ("cgroups in
#     hybrid mode not supported"), which runc accepts;
#   - explicit ulimits: without CAP_SYS_RESOURCE the runtime cannot raise RLIMIT_NOFILE to
#     podman's default 1048576 ("setrlimit RLIMIT_NOFILE: Operation not permitted"), so the
#     container gets the limits the host already has (see CONTAINER_ULIMITS).
set -eu
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TAG=${1:-${IMAGE_TAG:-localhost/loraserve:cpu-demo}}
BASE=${BASE_IMAGE:-localhost/loraserve-base:bookworm}
WORK=${IMAGE_WORK:-/var/tmp/loraserve-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}
RUNTIME=${CONTAINER_RUNTIME:-runc}
ULIMITS=${CONTAINER_ULIMITS:-"--ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=4096:4096"}
for tool in mmdebstrap buildah podman "$RUNTIME" git; do
  command -v "$tool" >/dev/null || { echo "build-image.sh: $tool is missing (apt-get install -y mmdebstrap buildah podman runc uidmap)" >&2; exit 2; }
done
mkdir -p "$WORK"

if ! podman image exists "$BASE"; then
  echo "build-image.sh: the base root file system (mmdebstrap, Debian bookworm)" >&2
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
    "$WORK/base.tar" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb $SECURITY bookworm-security main"
  podman import --change 'CMD ["/bin/sh"]' "$WORK/base.tar" "$BASE" >/dev/null
  rm -f "$WORK/base.tar"
fi

CONTEXT="$WORK/context"
rm -rf "$CONTEXT" && mkdir -p "$CONTEXT"
git -C "$REPO" archive --format=tar HEAD | tar -x -C "$CONTEXT"
COMMIT=$(git -C "$REPO" rev-parse --short HEAD)

set -- --format docker --runtime "$RUNTIME" --network host --layers=false \
  -f deploy/docker/Dockerfile.cpu --build-arg PYTHON_IMAGE="$BASE" --build-arg DEMO=1 --build-arg EXTRAS=s3 \
  --build-arg TORCH_INDEX= --label org.opencontainers.image.revision="$COMMIT" -t "$TAG"
if [ -d "$TORCH_FIND_LINKS" ]; then
  set -- "$@" --volume "$TORCH_FIND_LINKS:/mnt/torch-wheels:ro" --build-arg TORCH_FIND_LINKS=/mnt/torch-wheels
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  set -- "$@" --volume "$PIP_CERT:/mnt/pip-ca.crt:ro" --build-arg PIP_CERT=/mnt/pip-ca.crt
fi
echo "build-image.sh: building $TAG from $COMMIT" >&2
# shellcheck disable=SC2086
cd "$CONTEXT" && buildah bud $ULIMITS "$@" .
podman image inspect --format '{{.Id}} {{.Size}}' "$TAG"
