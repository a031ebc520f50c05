"""Shared fixtures: a fake engine served live by uvicorn, and clients for it."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from loraserve.server import build_app
from .fake_engine import FakeEngine
from .live import LiveServer


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    with LiveServer(build_app(engine, max_n=4)) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=30) as c:
        yield c


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
