"""`/v1/embeddings` is not served (issue 43, part 2): the OpenAI and vLLM embeddings call gets a
404 with an OpenAI error body that says so, under /v1 and the OAI prefix alike, and the real
openai client raises NotFoundError carrying that message."""
from __future__ import annotations

import httpx
import openai
import pytest

from loraserve.server import build_app

from .fake_engine import FakeEngine
from .live import LiveServer


def test_embeddings_answer_a_404_that_says_they_are_not_served() -> None:
    engine = FakeEngine(adapters=("acme/support",))
    with LiveServer(build_app(engine)) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        for path in ("/v1/embeddings", "/oai/api/v1/embeddings"):
            for model in ("fake-base", "acme/support"):
                r = http.post(path, json={"model": model, "input": ["hello", "world"]})
                assert r.status_code == 404, r.text
                err = r.json()["error"]
                assert err["code"] == "embeddings_not_served" and err["type"] == "invalid_request_error"
                assert "embeddings are not served" in err["message"]
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="embeddings are not served"):
            client.embeddings.create(model="fake-base", input="hello")
    assert engine.requests == []  # nothing reached the engine
