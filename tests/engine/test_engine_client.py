"""Issue 44's shape: one API-side `EngineClient` on every hosting, a `Transport` per hosting that
only moves messages and reports liveness. A hosting that grew its own client logic (a second
`generate`, its own calls or catalog) would fail here before it diverged in behaviour."""
from __future__ import annotations

import importlib.util

import pytest

from loraserve.engine.async_engine import AsyncEngine, ThreadTransport
from loraserve.engine.client.core_client import CoreClient, ProcessTransport
from loraserve.engine.client.frontend import EngineClient, Transport

# what the client does itself (what it reads off its transport, `snapshot` among them, excepted)
CLIENT_ONLY = ({name for name in vars(EngineClient) if not name.startswith("__")}
               - set(vars(Transport)) - set(Transport.__annotations__))


def _transports() -> list[type]:
    found = [ThreadTransport, ProcessTransport]
    if importlib.util.find_spec("ray") is not None:
        from loraserve.ray_serve.frontend import RayTransport
        found.append(RayTransport)
    return found


@pytest.mark.parametrize("transport", _transports(), ids=lambda t: t.__name__)
def test_a_transport_has_none_of_the_clients_work(transport: type) -> None:
    assert issubclass(transport, Transport) and not issubclass(transport, EngineClient)
    assert not CLIENT_ONLY & set(vars(transport)), "client logic in a transport"


@pytest.mark.parametrize("client", [AsyncEngine, CoreClient], ids=lambda c: c.__name__)
def test_the_named_hostings_are_the_one_client_built_over_a_transport(client: type) -> None:
    assert client.__bases__ == (EngineClient,)
    assert set(vars(client)) - {"__init__", "__doc__", "__module__", "__qualname__",
                                "from_config", "from_model_dir"} == set()
