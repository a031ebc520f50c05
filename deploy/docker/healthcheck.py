"""The images' HEALTHCHECK: exit 0 when the server on this host answers GET /health with 200.

/health says the process serves HTTP (liveness); /ready says it takes requests (the model is
loaded, the engine core is up, it is not draining) and is what a load balancer should probe.
The port is LORASERVE_PORT (default 8000), as deploy/docker/start.sh passes it to `serve`.
"""
import os
import sys
import urllib.request

port = os.environ.get("LORASERVE_PORT", "8000")
path = sys.argv[1] if len(sys.argv) > 1 else "/health"
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        sys.exit(0 if answer.status == 200 else 1)
except Exception as exc:  # refused, timed out, or a 5xx: unhealthy
    print(f"healthcheck {path}: {exc}", file=sys.stderr)
    sys.exit(1)
