#!/bin/sh
# Start the server: the images' ENTRYPOINT (tests/test_deploy_image.py starts it the same way).
#
# Every `serve` flag can be given as an argument, as LORASERVE_<FLAG> in the environment
# (LORASERVE_MODEL, LORASERVE_CATALOG, LORASERVE_KEYS, LORASERVE_MAX_BATCH_SIZE, ...) or in a
# TOML file named by LORASERVE_CONFIG (default: /etc/loraserve/serve.toml when it exists);
# arguments win over the environment, which wins over the file. In a container the server
# listens on 0.0.0.0 unless LORASERVE_HOST says otherwise. `exec`: the server is the process
# the runtime signals, so SIGTERM drains it (--shutdown-timeout) and SIGHUP re-reads the keys.
set -eu
VENV=${LORASERVE_VENV:-/opt/loraserve}
export LORASERVE_HOST="${LORASERVE_HOST:-0.0.0.0}"
CONFIG=${LORASERVE_CONFIG:-/etc/loraserve/serve.toml}
if [ -f "$CONFIG" ]; then
  exec "$VENV/bin/loraserve" serve --config "$CONFIG" "$@"
fi
if [ -n "${LORASERVE_CONFIG:-}" ]; then
  echo "start.sh: LORASERVE_CONFIG=$LORASERVE_CONFIG: no such file" >&2
  exit 2
fi
exec "$VENV/bin/loraserve" serve "$@"
