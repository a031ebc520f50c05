"""Fault isolation at the HTTP edge: every oversized, malformed or hostile input is refused on its
own (a 4xx with an OpenAI error body, the rest of the body unread or unparsed) and the server goes
on serving others; big inputs are handled off the event loop, so /health answers meanwhile."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from loraserve.adapters.limits import PoolLimits
from loraserve.catalog.errors import AdapterNotFound, RevisionNotFound
from loraserve.engine.directory import AdapterDirectory
from loraserve.engine.types import EngineError
from loraserve.server import build_app
from loraserve.server import protocol

from .fake_engine import FakeEngine, FakeTokenizer
from .live import LiveServer
from .test_bad_input import CHAT, GOOD, assert_error_body, assert_still_serving

MAX_BYTES = 4 * protocol.OFF_LOOP_BYTES  # bodies above OFF_LOOP_BYTES are parsed off the loop
MAX_MODEL_LEN = 64  # FakeEngine's: at most 64 * 16 = 1024 characters of text
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    with LiveServer(build_app(engine, max_n=4, max_request_bytes=MAX_BYTES,
                              max_seqs_per_request=8)) as live:
        yield live


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def raw(http: httpx.Client, text: str, path: str = "/v1/completions") -> httpx.Response:
    """POST `text` as the body, byte for byte (JSON literals and escapes json.dumps won't write)."""
    return http.post(path, content=text.encode("utf-8", "surrogatepass"), headers=JSON)


# -- 1. body size: 413 before parsing ----------------------------------------------------------------

def test_body_over_limit_by_content_length_is_413(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b"{" + b" " * MAX_BYTES + b"}", headers=JSON)
    error = assert_error_body(r, 413, None)
    assert error["code"] == "request_too_large" and str(MAX_BYTES) in error["message"]
    assert_still_serving(http)


def test_chunked_body_over_limit_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the middleware counts the stream
        yield b'{"model": "fake-base", "prompt": "'
        for _ in range(8):
            yield b"x" * (MAX_BYTES // 7)
        yield b'"}'

    error = assert_error_body(http.post("/v1/completions", content=chunks(), headers=JSON), 413,
                              None)
    assert error["code"] == "request_too_large"
    assert_still_serving(http)


def raw_exchange(server: LiveServer, head: bytes) -> bytes:
    """Send request headers only (no body) on a fresh socket; what the server answers."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


@pytest.mark.parametrize("extra", [b"Expect: 100-continue\r\n", b""], ids=["expect", "huge"])
def test_declared_oversize_is_413_before_any_body_is_sent(http: httpx.Client, server: LiveServer,
                                                          extra: bytes) -> None:
    # with Expect: 100-continue the client waits for the go-ahead; without it, a length past
    # what the server would read and drop: either way the 413 comes without reading the body
    length = MAX_BYTES + 1 if extra else 10**12
    answer = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\n" + extra +
                          f"Content-Length: {length}\r\n\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert_still_serving(http)


def test_body_at_the_limit_is_parsed(http: httpx.Client) -> None:
    body = json.dumps({**GOOD, "user": ""}).encode()
    body = body[:-2] + b" " * (MAX_BYTES - len(body)) + b'"}'  # exactly MAX_BYTES, valid JSON
    assert len(body) == MAX_BYTES
    r = http.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 200, r.text


def test_health_answers_while_a_big_body_is_still_arriving(http: httpx.Client,
                                                           server: LiveServer) -> None:
    sent_half, finish = threading.Event(), threading.Event()
    result: dict = {}

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "fake-base", "prompt": "' + b"x" * (MAX_BYTES // 2)
        sent_half.set()
        finish.wait(30)
        yield b"x" * MAX_BYTES + b'"}'

    def upload() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            result["r"] = c.post("/v1/completions", content=chunks(), headers=JSON)

    t = threading.Thread(target=upload)
    t.start()
    try:
        assert sent_half.wait(30)
        assert http.get("/health").status_code == 200  # the big request is still in flight
        assert "r" not in result
    finally:
        finish.set()
        t.join(30)
    assert_error_body(result["r"], 413, None)
    assert_still_serving(http)


# -- 1. sizes checked before tokenizing / per-item work ----------------------------------------------

SIZE_CASES = [
    ("text over the character bound", {**GOOD, "prompt": "x" * (MAX_MODEL_LEN * 16 + 1)},
     "prompt", "/v1/completions"),
    ("one of many texts too long", {**GOOD, "prompt": ["ab", "x" * (MAX_MODEL_LEN * 16 + 1)]},
     "prompt", "/v1/completions"),
    ("token ids longer than the context", {**GOOD, "prompt": [1] * (MAX_MODEL_LEN + 1)},
     "prompt", "/v1/completions"),
    ("one id list too long", {**GOOD, "prompt": [[1], [1] * (MAX_MODEL_LEN + 1)]},
     "prompt", "/v1/completions"),
    ("chat text over the bound",
     {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN * 16 + 1)}]},
     "messages", "/v1/chat/completions"),
    ("chat text parts over the bound",
     {**CHAT, "messages": [{"role": "user", "content": [
         {"type": "text", "text": "x" * (MAX_MODEL_LEN * 8 + 1)}] * 2}]},
     "messages", "/v1/chat/completions"),
    ("more messages than context tokens",
     {**CHAT, "messages": [{"role": "user", "content": ""}] * (MAX_MODEL_LEN + 1)},
     "messages", "/v1/chat/completions"),
]


@pytest.mark.parametrize("name,body,param,path", SIZE_CASES, ids=[c[0] for c in SIZE_CASES])
def test_input_too_long_is_refused_on_its_length(http: httpx.Client, engine: FakeEngine,
                                                 monkeypatch: pytest.MonkeyPatch, name: str,
                                                 body: dict, param: str, path: str) -> None:
    def no_tokenizing(*args: object, **kw: object) -> None:
        raise AssertionError("tokenized an input that cannot fit")

    monkeypatch.setattr(FakeTokenizer, "encode", no_tokenizing)
    error = assert_error_body(http.post(path, json=body), 400, param)
    assert error["code"] == "context_length_exceeded"
    monkeypatch.undo()
    assert_still_serving(http)


def test_too_many_sequences_is_400(http: httpx.Client, engine: FakeEngine) -> None:
    before = len(engine.requests)
    error = assert_error_body(http.post("/v1/completions", json={**GOOD, "prompt": ["a"] * 3,
                                                                 "n": 3}), 400, "n")
    assert error["code"] == "too_many_sequences" and "8" in error["message"]
    error = assert_error_body(http.post("/v1/completions", json={**GOOD, "prompt": ["a"] * 9}),
                              400, "prompt")
    assert error["code"] == "too_many_sequences"
    assert len(engine.requests) == before  # nothing was queued
    r = http.post("/v1/completions", json={**GOOD, "prompt": ["a"] * 4, "n": 2})  # 8: at the cap
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert_still_serving(http)


def test_default_caps_1000_prompts_times_16() -> None:
    with LiveServer(build_app(FakeEngine(), max_n=16)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        error = assert_error_body(http.post("/v1/completions", json={
            **GOOD, "prompt": ["a"] * 1000, "n": 16}), 400, "prompt")
        assert error["code"] == "too_many_sequences" and "256" in error["message"]
        error = assert_error_body(http.post("/v1/completions", json={
            **GOOD, "prompt": ["a"] * 17, "n": 16}), 400, "n")
        assert "272" in error["message"]
        assert_still_serving(http)


def test_huge_prompt_is_refused_off_the_event_loop(http: httpx.Client, server: LiveServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The parse of a big body runs on a worker thread: held there, /health still answers."""
    parsing, release = threading.Event(), threading.Event()
    real_parse = protocol.parse_body

    def held_parse(body: bytes, *args: object) -> object:
        if len(body) > protocol.OFF_LOOP_BYTES:
            parsing.set()
            release.wait(30)
        return real_parse(body, *args)

    monkeypatch.setattr(protocol, "parse_body", held_parse)
    result: dict = {}

    def post() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            result["r"] = c.post("/v1/completions", json={**GOOD, "prompt": "x" * (MAX_BYTES - 100)})

    t = threading.Thread(target=post)
    t.start()
    try:
        assert parsing.wait(30)
        assert http.get("/health").status_code == 200  # answered while the parse is held
        assert "r" not in result
    finally:
        release.set()
        t.join(30)
    error = assert_error_body(result["r"], 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert_still_serving(http)


def test_large_prompt_is_tokenized_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that fits but is large is tokenized on a worker thread: held there, /health
    still answers, and the request then completes."""
    engine = FakeEngine(max_model_len=40_000)
    tokenizing, release = threading.Event(), threading.Event()
    real_encode = FakeTokenizer.encode

    def held_encode(self: FakeTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > 16 * 1024:
            tokenizing.set()
            release.wait(30)
        return real_encode(self, text, add_special_tokens)

    monkeypatch.setattr(FakeTokenizer, "encode", held_encode)
    result: dict = {}
    with LiveServer(build_app(engine)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        def post() -> None:
            with httpx.Client(base_url=live.url, timeout=30) as c:
                result["r"] = c.post("/v1/completions", json={**GOOD, "prompt": "x" * 20_000})

        t = threading.Thread(target=post)
        t.start()
        try:
            assert tokenizing.wait(30)
            assert http.get("/health").status_code == 200
            assert "r" not in result
        finally:
            release.set()
            t.join(30)
        assert result["r"].status_code == 200, result["r"].text
        assert_still_serving(http)


# -- 3. hostile values -----------------------------------------------------------------------------

HOSTILE = [
    ("NaN temperature", '{"model": "fake-base", "prompt": "ab", "temperature": NaN}', "temperature"),
    ("Infinity temperature", '{"model": "fake-base", "prompt": "ab", "temperature": Infinity}',
     "temperature"),
    ("-Infinity top_p", '{"model": "fake-base", "prompt": "ab", "top_p": -Infinity}', "top_p"),
    ("overflowing float", '{"model": "fake-base", "prompt": "ab", "temperature": 1e999}',
     "temperature"),
    ("NaN in a message extra", '{"model": "fake-base", "messages": [{"role": "user", '
     '"content": "hi", "weight": NaN}]}', "messages.0.weight"),
    ("surrogate in prompt", '{"model": "fake-base", "prompt": "\\ud800"}', "prompt"),
    ("surrogate in prompt list", '{"model": "fake-base", "prompt": ["ok", "a\\udfffb"]}',
     "prompt.1"),
    ("surrogate in model", '{"model": "\\ud800", "prompt": "ab"}', "model"),
    ("surrogate in adapter id", '{"model": "acme/\\ud83d", "prompt": "ab"}', "model"),
    ("surrogate in content", '{"model": "fake-base", "messages": [{"role": "user", '
     '"content": "\\ud800"}]}', "messages.0.content"),
    ("surrogate in stop", '{"model": "fake-base", "prompt": "ab", "stop": ["\\udc00"]}', "stop.0"),
    ("surrogate in a key", '{"model": "fake-base", "prompt": "ab", "logit_bias": {"\\ud800": 1}}',
     "logit_bias.\ufffd"),
]


@pytest.mark.parametrize("name,body,param", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_values_are_400(http: httpx.Client, name: str, body: str, param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error_body(raw(http, body, path), 400, param)
    assert_still_serving(http)


def test_raw_surrogate_bytes_are_400(http: httpx.Client) -> None:
    body = b'{"model": "fake-base", "prompt": "a\xed\xa0\x80b"}'  # CESU-style surrogate bytes
    r = http.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", None)
    assert_still_serving(http)


def test_valid_astral_characters_pass(http: httpx.Client) -> None:
    r = raw(http, '{"model": "fake-base", "prompt": "\\ud83d\\ude00 ok", "max_tokens": 1}')
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={**GOOD, "prompt": "caf\u00e9 \U0001F600"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,code", [
    ('{"model": "fake-base", "prompt": "ab", "max_tokens": 1' + "0" * 5000 + "}", "invalid_json"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid_json"),
])
def test_unparsable_numbers_and_nesting_are_400(http: httpx.Client, body: str, code: str) -> None:
    assert assert_error_body(raw(http, body), 400, None)["code"] == code
    assert_still_serving(http)


@pytest.mark.parametrize("seed,status", [(2**63, 200), (2**64 - 1, 200), (-(2**63), 200),
                                         (2**64, 400), (2**70, 400), (-(2**63) - 1, 400)])
def test_seed_range(http: httpx.Client, seed: int, status: int) -> None:
    r = http.post("/v1/completions", json={**GOOD, "seed": seed, "n": 2})
    if status == 400:
        assert_error_body(r, 400, "seed")
    else:
        assert r.status_code == 200, r.text
    assert_still_serving(http)


def test_empty_stop_string_is_400(http: httpx.Client) -> None:
    assert_error_body(http.post("/v1/completions", json={**GOOD, "stop": [""]}), 400, "stop")
    assert_error_body(http.post("/v1/chat/completions", json={**CHAT, "stop": ""}), 400, "stop")
    assert_still_serving(http)


# -- 3. routes, methods, echoes --------------------------------------------------------------------

def test_unknown_route_is_not_found(http: httpx.Client) -> None:
    for r in (http.get("/v1/nothing"), http.post("/v1/nothing", json={}), http.get("/nope")):
        assert assert_error_body(r, 404, None)["code"] == "not_found"
    assert_still_serving(http)


def test_wrong_method_is_405_with_allow(http: httpx.Client) -> None:
    for method, path, allowed in [("GET", "/v1/completions", "POST"),
                                  ("DELETE", "/v1/chat/completions", "POST"),
                                  ("POST", "/v1/models", "GET"), ("POST", "/health", "GET")]:
        r = http.request(method, path)
        error = assert_error_body(r, 405, None)
        assert error["code"] == "method_not_allowed"
        assert allowed in r.headers["allow"]
    assert_still_serving(http)


def test_long_values_are_echoed_cut(http: httpx.Client) -> None:
    long_id = "acme/" + "b" * 10_000
    for r in (http.post("/v1/completions", json={**GOOD, "model": long_id}),
              http.post("/v1/completions", json={**GOOD, "model": "x" * 10_000}),
              http.get(f"/v1/models/{'y' * 10_000}")):
        error = assert_error_body(r, 404, "model")
        assert len(error["message"]) < 400 and "\u2026" in error["message"]
    assert_still_serving(http)


def test_long_param_is_cut(http: httpx.Client) -> None:
    key = "k" * 10_000
    r = http.post("/v1/completions", json={**GOOD, "logit_bias": {key: "not a number"}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert len(error["param"]) <= 256 and len(error["message"]) <= 1024
    assert_still_serving(http)


# -- 2. 429 carries Retry-After ----------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/completions", GOOD),
                                       ("/v1/completions", {**GOOD, "stream": True}),
                                       ("/v1/chat/completions", {**CHAT, "stream": True})])
def test_429_carries_retry_after(http: httpx.Client, engine: FakeEngine, path: str,
                                 body: dict) -> None:
    engine.fail_next = EngineError("queue full", status=429, code="rate_limit_exceeded")
    r = http.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert_still_serving(http)


# -- 3. @rev forms are resolved ----------------------------------------------------------------------

class FakeCatalog:
    adapters = {"demo/pirate": ("r1", {"prod": "r1"})}

    def resolve(self, adapter_id: str, revision: str | None = None) -> object:
        promoted, tags = self.adapters.get(adapter_id, (None, {}))
        if promoted is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} not found")
        rev = revision or promoted
        if rev != promoted and rev not in tags:
            raise RevisionNotFound(f"adapter {adapter_id!r} has no revision or tag {revision!r}")
        return SimpleNamespace(ref=f"{adapter_id}@{promoted}", adapter_id=adapter_id,
                               revision=promoted, base_fingerprint="fp", rank=2, targets=["q"])


class DirectoryEngine(FakeEngine):
    """The fake engine resolving names as a real one does: an AdapterDirectory over a catalog."""

    async def resolve(self, model: str, principal) -> object:
        directory = AdapterDirectory(self.model_name, FakeCatalog(), "fp", PoolLimits(8, ("q",)))
        return directory.resolve(model, principal)


def test_model_revision_is_resolved() -> None:
    """/v1/models/{id} answers as the completions routes resolve (the engine's AdapterDirectory):
    revisions, tags and the default tenant's bare names; the same 404 otherwise."""
    FakeCatalog.adapters = {"demo/pirate": ("r1", {"prod": "r1"}),
                            "default/sql-lora": ("r1", {})}
    with LiveServer(build_app(DirectoryEngine(adapters=()))) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        for ok in ("demo/pirate", "demo/pirate@r1", "demo/pirate@prod", "sql-lora",
                   "default/sql-lora"):
            r = http.get(f"/v1/models/{ok}")
            assert r.status_code == 200 and r.json()["id"] == ok, r.text
        for missing, code in [("demo/pirate@nope", "revision_not_found"),  # one it may see
                              ("demo/ghost", "model_not_found"),  # names.not_found
                              ("demo/ghost@r1", "model_not_found"),
                              ("demo/pirate@bad@rev", "model_not_found"),  # no valid id
                              (f"demo/{'b' * 10_000}", "model_not_found")]:
            error = assert_error_body(http.get(f"/v1/models/{missing}"), 404, "model")
            assert error["code"] == code and len(error["message"]) < 400
        assert http.get("/v1/models/fake-base").status_code == 200
        assert_still_serving(http)


# -- 3. the OpenAPI document describes the errors really sent ---------------------------------------

def test_openapi_documents_error_responses(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(doc)
    error_ref = "#/components/schemas/ErrorResponse"
    assert set(doc["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            assert "422" not in responses, (path, method)
            assert {"400", "401", "404", "413", "429", "500", "503"} <= set(responses)
            assert "Retry-After" in responses["429"]["headers"]
            for status, response in responses.items():
                if not status.startswith("2"):
                    assert response["content"]["application/json"]["schema"]["$ref"] == error_ref


def test_validation_errors_are_400_not_422(http: httpx.Client) -> None:
    for body in ({"model": 1}, {"model": "fake-base", "prompt": {"a": 1}}, {}):
        assert http.post("/v1/completions", json=body).status_code == 400
    assert http.get("/v1/models", params={"limit": "many"}).status_code == 400
    assert_still_serving(http)


# -- units: echo clipping, defaults, the flags -----------------------------------------------------

def test_error_messages_clip_echoed_values_where_they_stand() -> None:
    from loraserve.catalog.errors import InvalidAdapterId
    from loraserve.server.errors import ECHO_MAX, as_api_error

    long_id = "demo/" + "b" * 10_000
    error = as_api_error(InvalidAdapterId(f"invalid name in {long_id!r}: longer than 128 chars"))
    assert error.status == 400 and len(error.message) < ECHO_MAX + 64
    assert error.message.startswith("invalid name in 'demo/b") and "\u2026" in error.message
    assert error.message.endswith("longer than 128 chars")
    many = as_api_error(EngineError(" ".join(["x" * 200] * 50))).message  # many long words
    assert len(many) <= 1024
    assert as_api_error(EngineError("short and sweet")).message == "short and sweet"


def test_limits_default_to_server_config() -> None:
    from loraserve.server.config import ServerConfig

    ctx = build_app(FakeEngine()).state.ctx
    assert (ctx.max_request_bytes, ctx.max_seqs_per_request, ctx.shutdown_timeout) == \
        (16 * 2**20, 256, 30.0)
    for name in ("max_request_bytes", "max_seqs_per_request", "max_n"):
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: 0})
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ServerConfig(shutdown_timeout=-1)
    with pytest.raises(TypeError, match="not both"):
        build_app(FakeEngine(), ServerConfig(), max_n=2)


def test_serve_flags_set_the_limits() -> None:
    from loraserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-request-bytes", "1024",
                                      "--max-seqs-per-request", "4", "--shutdown-timeout", "2.5"])
    assert (args.max_request_bytes, args.max_seqs_per_request, args.shutdown_timeout) == \
        (1024, 4, 2.5)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_request_bytes, defaults.max_seqs_per_request,
            defaults.shutdown_timeout) == (16 * 2**20, 256, 30.0)


def test_default_body_limit_is_16_mib() -> None:
    with LiveServer(build_app(FakeEngine())) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        answer = raw_exchange(live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nExpect: 100-continue\r\n" +
                              f"Content-Length: {16 * 2**20 + 1}\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 413")
        assert_still_serving(http)
