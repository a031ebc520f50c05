"""Drive `wrk` (the C HTTP benchmarking tool, Debian package `wrk`) for raw request rate.

wrk runs a closed loop (`-c` connections) and knows nothing of streamed events, so a wrk run
reports end-to-end latency only (no TTFT), from wrk's own histogram. Bodies (one JSON document a
line) are cycled through per connection thread by a small Lua script, which also counts
responses by status and prints one JSON line at the end. `find_wrk()` is None when wrk is not
installed: callers fall back to the built-in client.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

MARK = "WRK_RESULT "
PERCENTILES = [i / 10 for i in range(10, 1000, 10)] + [99.5, 99.9, 99.99]

_SCRIPT = r"""
local threads = {}
local counter = 0
local id = 0
local bodies = {}
statuses = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
  counter = id
end

function request()
  counter = counter + 1
  return wrk.format("POST", PATH, HEADERS, bodies[(counter - 1) % #bodies + 1])
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local total, counts = {}, {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses")) do
      total[status] = (total[status] or 0) + n
    end
  end
  for status, n in pairs(total) do
    counts[#counts + 1] = string.format('"%d": %d', status, n)
  end
  local pcts = {}
  for _, p in ipairs(PERCENTILES) do
    pcts[#pcts + 1] = string.format('[%g, %d]', p, latency:percentile(p))
  end
  local e = summary.errors
  io.write(string.format(
    'MARK{"requests": %d, "duration_us": %d, "bytes": %d, "statuses": {%s}, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ' ..
    '"latency_us": {"min": %d, "max": %d, "mean": %f, "percentiles": [%s]}}\n',
    summary.requests, summary.duration, summary.bytes, table.concat(counts, ", "),
    e.connect, e.read, e.write, e.timeout, latency.min, latency.max, latency.mean,
    table.concat(pcts, ", ")))
end
"""


def find_wrk() -> str | None:
    return shutil.which("wrk")


def _lua_string(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lua string literal for ASCII text


def script(path: str, headers: dict[str, str]) -> str:
    head = "{" + ", ".join(f"[{_lua_string(k)}] = {_lua_string(v)}" for k, v in headers.items()) + "}"
    return (f"PATH = {_lua_string(path)}\nHEADERS = {head}\n"
            f"PERCENTILES = {{{', '.join(str(p) for p in PERCENTILES)}}}\n"
            + _SCRIPT.replace("MARK", MARK))


async def run_wrk(url: str, path: str, bodies: list[bytes], headers: dict[str, str], *,
                  connections: int, duration: float, threads: int = 1, timeout: float = 120.0,
                  wrk: str | None = None) -> dict:
    """Run wrk against url+path for `duration` seconds; its result (see the Lua `done` above)."""
    wrk = wrk or find_wrk()
    if wrk is None:
        raise FileNotFoundError("wrk is not installed")
    with tempfile.TemporaryDirectory(prefix="loraserve-wrk-") as tmp:
        lua, lines = Path(tmp) / "post.lua", Path(tmp) / "bodies.jsonl"
        lua.write_text(script(path, {"Content-Type": "application/json", **headers}))
        lines.write_bytes(b"\n".join(bodies) + b"\n")
        threads = max(1, min(threads, connections))
        proc = await asyncio.create_subprocess_exec(
            wrk, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration))}s",
            "--timeout", f"{max(1, round(timeout))}s", "-s", str(lua), url.rstrip("/"), "--", str(lines),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
    text = out.decode(errors="replace")
    for line in text.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"wrk failed (exit {proc.returncode}): {err.decode(errors='replace')[-500:] or text[-500:]}")
