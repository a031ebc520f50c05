"""A small HTTP server speaking the Hugging Face Hub's file routes, for a real huggingface_hub client.

`hf_hub_download` needs (huggingface_hub 2.x, file_download.py): `HEAD` and `GET`
`/{repo}/resolve/{revision}/{file}` answering `X-Repo-Commit` (the commit, which names the cache's
snapshot folder), `ETag` (the SHA-256 of an LFS file, or the git blob SHA-1 of a regular one:
the cache stores the blob under it) and `Content-Length`; a missing repo or file is a 404 with
`X-Error-Code: RepoNotFound` / `EntryNotFound`, which the client turns into its typed errors.
`/api/models/{repo}/revision/{revision}` answers the repo's sha and files (snapshot_download's
listing). Repos are folders `root/owner/name/`; `lie[path] = bytes` serves other bytes than
the ETag states (a corrupt transfer).
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0" * 39 + "1"
LFS_SUFFIXES = (".safetensors", ".bin")


def etag_of(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.lie: dict[str, bytes] = {}
        self.requests: list[str] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                status, headers, data = hub.route(self.path.split("?")[0])
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler

    def route(self, path: str) -> tuple[int, dict, bytes]:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            return self._info("/".join(parts[2:4]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file("/".join(parts[:2]), "/".join(parts[4:]))
        return 404, {}, b"not found"

    def _info(self, repo: str) -> tuple[int, dict, bytes]:
        folder = self.root / repo
        if not folder.is_dir():
            return 404, {"X-Error-Code": "RepoNotFound"}, b"{}"
        files = [{"rfilename": f.name} for f in sorted(folder.iterdir())]
        body = json.dumps({"id": repo, "sha": COMMIT, "siblings": files}).encode()
        return 200, {"Content-Type": "application/json"}, body

    def _file(self, repo: str, name: str) -> tuple[int, dict, bytes]:
        folder = self.root / repo
        if not folder.is_dir():
            return 404, {"X-Error-Code": "RepoNotFound"}, b""
        f = folder / name
        if not f.is_file():
            return 404, {"X-Error-Code": "EntryNotFound"}, b""
        data = f.read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag_of(name, data)}"'}
        return 200, headers, self.lie.get(f"{repo}/{name}", data)
