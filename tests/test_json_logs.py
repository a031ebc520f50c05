"""`loraserve serve --log-format json` (issue 43, part 4): every line the server writes, on stdout
and stderr, from start to exit, is one JSON object: the API server's, the engine-core process's
(its start lines), uvicorn's shutdown lines and whatever a library prints as the processes exit.
Each request's line has its id, tenant, adapter id@rev, key id (never the key), tokens and
latency."""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from loraserve.keys import Principal, append_key

from serve_process import ServeProcess, build_served


def test_every_line_of_a_json_server_is_a_json_object(tmp_path: Path) -> None:
    base, catalog = build_served(tmp_path)
    keys = tmp_path / "keys.toml"
    key = append_key(keys, Principal("acme-ci", admin=False, tenants=("acme",)))
    server = ServeProcess(base, catalog, "--log-format", "json", "--keys", str(keys),
                          "--max-gpu-adapters", "1")
    try:
        auth = {"Authorization": f"Bearer {key}", "X-Request-Id": "req-adapter"}
        with httpx.Client(base_url=server.url, timeout=120) as http:
            r = http.post("/v1/completions", headers=auth, json={
                "model": "acme/b", "prompt": "one two", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
            with http.stream("POST", "/v1/chat/completions",
                             headers={**auth, "X-Request-Id": "req-stream"},
                             json={"model": "acme/a", "stream": True, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]}) as s:
                assert s.status_code == 200 and "[DONE]" in s.read().decode()
            refused = http.post("/v1/completions", headers={"X-Request-Id": "req-401"},
                                json={"model": "acme/b", "prompt": "x", "max_tokens": 1})
            assert refused.status_code == 401
    finally:
        rc = server.stop()
    assert rc in (0, 130), server.output()  # 130: ended by SIGINT, as a shell reports Ctrl-C
    lines = {name: [json.loads(line) for line in got if line.strip()]  # raises on a non-JSON line
             for name, got in server.lines.items()}
    records = lines["stdout"] + lines["stderr"]
    assert all(isinstance(r, dict) and {"time", "level", "message"} <= r.keys() for r in records)
    assert not any(key in json.dumps(r) for r in records)  # the key is never written
    core = [r for r in records if r.get("process") == "core"]
    assert core, "the engine core's start lines"
    messages = [r["message"] for r in records]
    assert any("Finished server process" in m for m in messages)  # the last shutdown line
    assert not any("Traceback" in m for m in messages)  # a clean stop
    by_id = {r["request_id"]: r for r in records if r.get("logger") == "loraserve.server.access"}
    done = by_id["req-adapter"]
    assert (done["status"], done["tenant"], done["key_id"], done["adapter"]) == \
        (200, "acme", "acme-ci", "acme/b@r1")
    assert done["prompt_tokens"] > 0 and done["completion_tokens"] == 3
    assert 0 < done["ttft_s"] <= done["total_s"]
    stream = by_id["req-stream"]
    assert (stream["key_id"], stream["adapter"], stream["completion_tokens"]) == \
        ("acme-ci", "acme/a@r1", 2)
    assert (by_id["req-401"]["status"], by_id["req-401"]["key_id"]) == (401, None)
