"""Run an ASGI app under uvicorn in a background thread on 127.0.0.1, ephemeral port."""
from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from loraserve.server.app import draining_server


class LiveServer:
    """`with LiveServer(app) as s:` serves `app` at `s.url` until the block ends.

    `drain=True` serves it as `loraserve serve` does (DrainingServer: shutdown drains requests in
    flight up to the app's shutdown_timeout); `begin_shutdown()` starts that as SIGTERM would.
    """

    def __init__(self, app: FastAPI, startup_timeout_s: float = 60.0, drain: bool = False):
        if drain:
            self.server: uvicorn.Server = draining_server(app, port=0, log_level="warning",
                                                          lifespan="on")
        else:
            config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                    lifespan="on")
            self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.startup_timeout_s = startup_timeout_s
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def begin_shutdown(self) -> None:
        """What SIGTERM does: uvicorn stops accepting and shuts down (draining, with drain)."""
        self.server.should_exit = True

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
