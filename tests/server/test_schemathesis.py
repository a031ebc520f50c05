"""Property-based API test: schemathesis generates requests from the server's own OpenAPI document
(valid and invalid ones) and every answer must be a non-5xx with a status and content type the
document lists. Bounded: at most EXAMPLES per operation, 200 in all."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance,  # noqa: E402
                                               status_code_conformance)

from loraserve.server import build_app  # noqa: E402

from .fake_engine import FakeEngine  # noqa: E402
from .live import LiveServer  # noqa: E402

TOTAL_EXAMPLES = 200
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]

schema = schemathesis.openapi.from_dict(build_app(FakeEngine(), max_n=4).openapi())
OPERATIONS = sum(1 for _ in schema.get_all_operations())
EXAMPLES = max(1, TOTAL_EXAMPLES // OPERATIONS)  # per operation


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[tuple[LiveServer, requests.Session]]:
    with LiveServer(build_app(FakeEngine(), max_n=4)) as live, requests.Session() as session:
        yield live, session


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzzed: tuple[LiveServer, requests.Session]) -> None:
    live, session = fuzzed
    response = case.call(base_url=live.url, session=session, timeout=30)
    assert response.status_code < 500, response.text
    case.validate_response(response, checks=CHECKS)
    health = session.get(f"{live.url}/health", timeout=30)  # and it goes on serving
    assert health.status_code == 200


def test_the_run_is_bounded() -> None:
    assert 0 < OPERATIONS * EXAMPLES <= TOTAL_EXAMPLES
    assert EXAMPLES >= 10  # enough per operation to mean something
